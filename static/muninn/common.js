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
  window.Muninn = {csrfToken, apiError, escapeHtml, errorHtml, postJson, getJson};
  // <form data-confirm="question">: asks before submitting (the Content-Security-Policy allows no inline handlers).
  document.addEventListener("submit", function (event) {
    const question = event.target.getAttribute && event.target.getAttribute("data-confirm");
    if (question && !window.confirm(question)) event.preventDefault();
  });
})();
