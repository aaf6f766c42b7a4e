// The job page's "Try the model" panel: sends the rows, image or prompt to POST /api/jobs/<id>/predict and shows
// the answer; a whole file is predicted in the background and its CSV offered when done (without JavaScript the form posts
// to the bounded in-request endpoint, ?format=csv).
(function () {
  "use strict";
  const panel = document.getElementById("try-model");
  if (!panel) return;
  const url = panel.dataset.url;
  const answer = document.getElementById("try-answer");
  const M = window.Muninn;

  function percent(p) {
    return (100 * p).toFixed(p >= 0.995 || p < 0.001 ? 0 : 1) + " %";
  }

  function predictionsHtml(result) {
    if (result.task === "language_model") {
      return '<p class="generated"><span class="muted">' + M.escapeHtml(result.prompt) + "</span>" +
        '<strong id="try-text">' + M.escapeHtml(result.text) + "</strong></p>";
    }
    const rows = result.predictions.map(function (p) {
      let what;
      if (result.task === "regression") {
        what = '<td class="num try-prediction">' + M.escapeHtml(Number(p.value).toPrecision(6)) + "</td><td></td>";
      } else {
        const top = Object.entries(p.probabilities).sort((a, b) => b[1] - a[1]).slice(0, 3)
          .map(([name, q]) => M.escapeHtml(name) + ": " + percent(q)).join(", ");
        what = '<td class="try-prediction"><strong>' + M.escapeHtml(p.label) + "</strong></td><td class=\"small muted\">" +
          top + "</td>";
      }
      return "<tr><td>" + M.escapeHtml(p.row) + "</td>" + what + "</tr>";
    }).join("");
    const head = result.task === "regression" ? "Predicted value" : "Prediction";
    return '<table id="try-table"><thead><tr><th>Row</th><th>' + head + "</th><th>" +
      (result.task === "regression" ? "" : "Most likely") + "</th></tr></thead><tbody>" + rows + "</tbody></table>";
  }

  async function send(body) {
    const init = {method: "POST", credentials: "same-origin", headers: {"X-CSRFToken": M.csrfToken()}};
    if (body instanceof FormData) {
      init.body = body;
    } else {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    return fetch(url, init);
  }

  const form = document.getElementById("try-form");
  if (form) {
    form.addEventListener("submit", async function (event) {
      event.preventDefault();
      const kind = panel.dataset.kind;
      let body;
      if (kind === "table") {
        body = {csv: document.getElementById("try-csv").value};
      } else if (kind === "image") {
        body = new FormData();
        body.append("file", document.getElementById("try-file").files[0]);
      } else {
        body = {prompt: document.getElementById("try-prompt").value,
                length: parseInt(document.getElementById("try-length").value, 10) || 100};
      }
      answer.innerHTML = '<p class="muted">Predicting…</p>';
      try {
        const response = await send(body);
        const text = await response.text();
        if (!response.ok) throw M.apiError(response.status, text);
        answer.innerHTML = predictionsHtml(JSON.parse(text));
      } catch (error) {
        answer.innerHTML = M.errorHtml(error.message ? error : {message: String(error)}, "try-error");
      }
    });
  }

  // A whole file is predicted in the background (POST .../predictions): its progress shows until the CSV is ready.
  const batch = document.getElementById("batch-form");
  if (batch) {
    batch.addEventListener("submit", async function (event) {
      event.preventDefault();
      const body = new FormData(batch);
      answer.innerHTML = '<p class="muted" id="batch-progress">Sending the file…</p>';
      try {
        const response = await fetch(panel.dataset.batchUrl, {method: "POST", credentials: "same-origin",
                                                              headers: {"X-CSRFToken": M.csrfToken()}, body: body});
        const text = await response.text();
        if (!response.ok) throw M.apiError(response.status, text);
        let state = JSON.parse(text);
        const statusUrl = panel.dataset.batchUrl + "/" + state.id;
        while (state.status === "queued" || state.status === "running") {
          document.getElementById("batch-progress").textContent = state.rows
            ? "Predicting… " + state.done_rows.toLocaleString() + " of " + state.rows.toLocaleString() + " rows"
            : "Waiting for the model…";
          await new Promise((resolve) => setTimeout(resolve, 1000));
          state = await M.getJson(statusUrl);
        }
        if (state.status === "failed") throw state.error;
        const link = document.createElement("a");
        link.href = state.csv_url;
        link.id = "batch-download";
        link.className = "button";
        link.setAttribute("download", "");
        link.textContent = "Download the predictions of " + state.rows.toLocaleString() + " rows (.csv)";
        answer.innerHTML = "";
        answer.appendChild(link);
      } catch (error) {
        answer.innerHTML = M.errorHtml(error.message ? error : {message: String(error)}, "try-error");
      }
    });
  }
})();
