// The new-job page: show the chosen template's hyper-parameters and ask for a fresh quote (POST /api/quotes)
// whenever the form changes, debounced; the accept button carries the quote's id.
(function () {
  "use strict";
  const form = document.getElementById("job-form");
  if (!form) return;
  const $ = (id) => document.getElementById(id);
  const templateSelect = $("id_template");
  const datasetSelect = $("id_dataset");
  let timer = null;
  let sequence = 0;

  function showTemplate() {
    document.querySelectorAll("fieldset.hparams").forEach((fs) => {
      const on = fs.dataset.template === templateSelect.value;
      fs.hidden = !on;
      fs.disabled = !on;
    });
  }

  function showAlgorithm() {
    const fs = $("diloco-settings");
    fs.hidden = fs.disabled = $("id_algorithm").value !== "diloco";
  }

  function value(input) {
    const text = input.value.trim();
    if (text === "") return undefined;
    const kind = input.dataset.kind;
    if (kind === "int_list") {
      const parts = text.replace(/[\[\]]/g, "").split(",").map((p) => p.trim()).filter((p) => p !== "");
      return parts.every((p) => /^-?\d+$/.test(p)) ? parts.map(Number) : text;
    }
    if (kind === "int") return /^-?\d+$/.test(text) ? Number(text) : text;
    if (kind === "float") return isFinite(Number(text)) ? Number(text) : text;
    return text;
  }

  function choice() {
    const hparams = {};
    const fs = document.querySelector('fieldset.hparams[data-template="' + templateSelect.value + '"]');
    if (fs) fs.querySelectorAll("input").forEach((input) => {
      const v = value(input);
      if (v !== undefined) hparams[input.dataset.name] = v;
    });
    const rounds = $("id_rounds").value.trim();
    const body = {dataset: Number(datasetSelect.value), template: templateSelect.value, hparams: hparams,
                  rounds: /^\d+$/.test(rounds) ? Number(rounds) : rounds, aggregation: $("id_aggregation").value};
    body.algorithm = $("id_algorithm").value;
    body.update_encoding = $("id_update_encoding").value;
    if (body.algorithm === "diloco") {
      ["outer_lr", "outer_momentum", "inner_steps"].forEach((name) => {
        const v = value($("id_" + name));
        if (v !== undefined) body[name] = v;
      });
    }
    const base = $("id_base_weights");
    if (base && base.value) body.base_weights = Number(base.value);
    return body;
  }

  function seconds(s) {
    if (s === null || s === undefined) return "waiting for a capable device to come online";
    if (s < 90) return "about " + Math.round(s) + " s";
    if (s < 5400) return "about " + Math.round(s / 60) + " min";
    return "about " + (s / 3600).toFixed(1) + " h";
  }

  function showQuote(q) {
    $("quote-error").innerHTML = "";
    const F = Muninn.figures;  // rounded as the page's filters round them, the exact figure on hover
    F.show($("quote-hu"), F.hu(F.huToFlops(q.hu)));
    F.show($("quote-price"), F.money(q.price.nanos, q.price.currency));
    F.show($("quote-minimum"), F.money(q.minimum_charge.nanos, q.minimum_charge.currency));
    $("quote-tier").textContent = q.device_tier.line;
    $("quote-warning").textContent = q.device_tier.warning || "";
    $("quote-warning").hidden = !q.device_tier.warning;
    $("quote-time").textContent = seconds(q.expected_seconds);
    $("quote-devices").textContent = q.devices_online === 0
      ? "none right now: the job waits until a device that can run it comes online"
      : String(q.devices_online);
    $("quote-figures").hidden = false;
    $("quote-waiting").hidden = true;
    $("id_quote").value = q.id;
    $("accept-button").disabled = false;
  }

  function showError(error) {
    $("quote-error").innerHTML = Muninn.errorHtml(error, "quote-error-message");
    $("quote-figures").hidden = true;
    $("quote-warning").hidden = true;
    $("quote-waiting").hidden = true;
    $("id_quote").value = "";
    $("accept-button").disabled = true;
  }

  async function requestQuote() {
    const mine = ++sequence;
    $("accept-button").disabled = true;
    try {
      const q = await Muninn.postJson(form.getAttribute("data-quote-api"), choice());
      if (mine === sequence) showQuote(q);
    } catch (error) {
      if (mine === sequence) showError(error);
    }
  }

  function changed() {
    window.clearTimeout(timer);
    $("accept-button").disabled = true;
    timer = window.setTimeout(requestQuote, 400);
  }

  templateSelect.addEventListener("change", () => { showTemplate(); changed(); });
  $("id_algorithm").addEventListener("change", () => { showAlgorithm(); changed(); });
  datasetSelect.addEventListener("change", () => {
    // Another dataset has other templates and defaults: the server renders them.
    window.location.search = "?dataset=" + encodeURIComponent(datasetSelect.value);
  });
  form.addEventListener("input", (e) => { if (e.target !== datasetSelect) changed(); });
  $("quote-button").hidden = true;  // the script keeps the quote current
  showTemplate();
  showAlgorithm();
  if (!$("id_quote").value && !$("quote-error").innerHTML.trim()) requestQuote();
})();
