// Small helpers shared by the pages' scripts: the CSRF token, JSON fetches with the API's error shape.
(function () {
  "use strict";
  function csrfToken() {
    const input = document.querySelector("input[name=csrfmiddlewaretoken]");
    if (input) return input.value;
    const m = document.cookie.match(/(?:^|;\s*)csrftoken=([^;]+)/);
    return m ? decodeURIComponent(m[1]) : "";
  }
  // The API answers errors as {"error": {"code", "message", "detail"}}; anything else becomes one sentence.
  function apiError(status, text) {
    try {
      const body = JSON.parse(text);
      if (body && body.error) return body.error;
    } catch (e) { /* not JSON: a proxy's page, a crash */ }
    return {code: "http_" + status, message: "The server answered " + status + ". Please try again.", detail: {}};
  }
  function escapeHtml(s) {
    return String(s).replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
  }
  // Amounts in an error's detail are nano-units for programs; the message already says them in money.
  const MONEY_DETAIL_KEYS = ["price", "balance", "amount", "available", "minimum"];
  // The same markup as templates/_error.html: the message, then where (row, column, file, field, ...).
  function errorHtml(error, id) {
    const lines = Object.entries(error.detail || {})
      .filter(([k, v]) => (v === null || typeof v !== "object") && !MONEY_DETAIL_KEYS.includes(k))
      .map(([k, v]) => "<li>" + escapeHtml(k.replace(/_/g, " ") + ": " + v) + "</li>");
    return '<div class="error" role="alert" id="' + (id || "form-error") + '"><strong>' + escapeHtml(error.message) +
      "</strong>" + (lines.length ? "<ul>" + lines.join("") + "</ul>" : "") + "</div>";
  }
  async function postJson(url, body) {
    const response = await fetch(url, {
      method: "POST", credentials: "same-origin",
      headers: {"Content-Type": "application/json", "X-CSRFToken": csrfToken(), "Accept": "application/json"},
      body: JSON.stringify(body),
    });
    const text = await response.text();
    if (!response.ok) throw apiError(response.status, text);
    return JSON.parse(text);
  }
  async function getJson(url) {
    const response = await fetch(url, {credentials: "same-origin", headers: {"Accept": "application/json"}});
    const text = await response.text();
    if (!response.ok) throw apiError(response.status, text);
    return JSON.parse(text);
  }

  // Figures as people read them, the mirror of platform/muninn/figures.py (tests/test_figures.py keeps the two
  // agreeing): money to the cent ("< €0.01" under a cent), work in HU with an SI prefix from 1 mHU up and in FLOP
  // below, each with its exact value for the title attribute. Integers are BigInt: FLOPs pass 2^53 at under 1 HU.
  const NANOS_PER_UNIT = 1000000000n, CENT = 10000000n, FLOPS_PER_HU = 10n ** 16n, HU_DIGITS = 3;
  const CURRENCY_SYMBOLS = {EUR: "€", USD: "$", GBP: "£"};
  const HU_PREFIXES = {"-3": "m", "0": "", "3": "k", "6": "M", "9": "G"};
  const FLOP_PREFIXES = {"0": "", "3": "k", "6": "M", "9": "G", "12": "T"};
  const symbol = (currency) => CURRENCY_SYMBOLS[currency] || currency + " ";
  const grouped = (n) => n.toString().replace(/\B(?=(\d{3})+(?!\d))/g, ",");
  const abs = (n) => (n < 0n ? -n : n);
  function halfEven(n, d) {  // n / d for n >= 0, rounded half to even
    const q = n / d, twice = 2n * (n % d);
    return twice > d || (twice === d && q % 2n === 1n) ? q + 1n : q;
  }
  function moneyExact(nanos, currency) {
    nanos = BigInt(nanos);
    const a = abs(nanos);
    const digits = (a % NANOS_PER_UNIT).toString().padStart(9, "0").replace(/0+$/, "").padEnd(2, "0");
    return (nanos < 0n ? "-" : "") + symbol(currency) + grouped(a / NANOS_PER_UNIT) + "." + digits;
  }
  function moneyText(nanos, currency) {
    nanos = BigInt(nanos);
    const a = abs(nanos);
    if (a > 0n && a < CENT) return (nanos > 0n ? "< " : "> -") + symbol(currency) + "0.01";
    const cents = halfEven(a, CENT);
    return moneyExact((nanos < 0n ? -cents : cents) * CENT, currency);
  }
  function withPrefix(coefficient, exponent, shift, prefixes, unit) {  // coefficient × 10^(exponent + shift)
    const powers = Object.keys(prefixes).map(Number);
    const adjusted = coefficient.toString().length - 1 + exponent + shift;
    const fitting = powers.filter((p) => p <= adjusted);
    const power = fitting.length ? Math.max(...fitting) : Math.min(...powers);
    const k = exponent + shift - power;
    let text;
    if (k >= 0) text = grouped(coefficient * 10n ** BigInt(k));
    else {
      const scale = 10n ** BigInt(-k);
      const frac = (coefficient % scale).toString().padStart(-k, "0").replace(/0+$/, "");
      text = frac ? (coefficient / scale).toString() + "." + frac : grouped(coefficient / scale);
    }
    return text + " " + prefixes[power] + unit;
  }
  function huText(flops, digits) {
    flops = BigInt(flops);
    digits = digits || HU_DIGITS;
    if (flops < 0n) throw new RangeError("work is never negative");
    if (flops === 0n) return "0 HU";
    const length = flops.toString().length;
    let coefficient = flops, exponent = 0;
    if (length > digits) {  // round to `digits` significant digits; 999.5 becomes 1000, one digit longer
      exponent = length - digits;
      coefficient = halfEven(flops, 10n ** BigInt(exponent));
      if (coefficient.toString().length > digits) { coefficient /= 10n; exponent += 1; }
    }
    if (coefficient * 10n ** BigInt(exponent) >= FLOPS_PER_HU / 1000n) {
      return withPrefix(coefficient, exponent, -16, HU_PREFIXES, "HU");
    }
    return withPrefix(coefficient, exponent, 0, FLOP_PREFIXES, "FLOP");
  }
  function huExact(flops) {
    flops = BigInt(flops);
    const frac = (flops % FLOPS_PER_HU).toString().padStart(16, "0").replace(/0+$/, "");
    return (flops / FLOPS_PER_HU).toString() + (frac ? "." + frac : "") + " HU (" + grouped(flops) + " FLOP" +
      (flops === 1n ? "" : "s") + ")";
  }
  // An exact HU string, as the API writes it ("0.0000000512434176"), as FLOPs.
  function huToFlops(hu) {
    const [whole, frac = ""] = String(hu).split(".");
    return BigInt(whole) * FLOPS_PER_HU + BigInt(frac.padEnd(16, "0") || "0");
  }
  const figures = {
    money: (nanos, currency) => ({text: moneyText(nanos, currency), title: "exactly " + moneyExact(nanos, currency)}),
    hu: (flops) => ({text: huText(flops), title: "exactly " + huExact(flops)}),
    moneyText, moneyExact, huText, huExact, huToFlops,
    // The same markup as the templates' money and hu filters (muninn/ui.py).
    html: (figure) => '<span class="figure-value" title="' + escapeHtml(figure.title) + '">' + escapeHtml(figure.text) +
      "</span>",
    show: (element, figure) => { if (element) element.innerHTML = figures.html(figure); },
  };
  window.Muninn = {csrfToken, apiError, escapeHtml, errorHtml, postJson, getJson, figures};
  // <form data-confirm="question">: asks before submitting (the Content-Security-Policy allows no inline handlers).
  document.addEventListener("submit", function (event) {
    const question = event.target.getAttribute && event.target.getAttribute("data-confirm");
    if (question && !window.confirm(question)) event.preventDefault();
  });
})();
