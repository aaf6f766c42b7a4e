// The job page: draws each round's losses and held-out metric with Chart.js (served by the site itself) and
// polls the job's progress every two seconds while it runs.
(function () {
  "use strict";
  const script = document.currentScript;
  const progressUrl = script.dataset.progressUrl;
  let state = JSON.parse(document.getElementById("job-state").textContent);
  const startedEnded = state.ended;
  const METRICS = [
    {key: "test_accuracy", label: "test accuracy", format: (v) => v.toFixed(3)},
    {key: "test_rmse", label: "test RMSE", format: (v) => v.toFixed(3)},
    {key: "test_perplexity", label: "test perplexity", format: (v) => v.toFixed(2)},
  ];
  const esc = Muninn.escapeHtml;

  function mainMetric(rounds, fallback) {
    for (const m of METRICS) {
      if (rounds.some((r) => r.metrics[m.key] !== undefined) || (fallback && fallback[m.key] !== undefined)) return m;
    }
    return null;
  }

  const canvas = document.getElementById("job-chart");
  const chart = new Chart(canvas, {
    type: "line",
    data: {labels: [], datasets: [
      {label: "train loss", data: [], yAxisID: "loss", borderColor: "#d9822b", backgroundColor: "#d9822b", tension: .2},
      {label: "test loss", data: [], yAxisID: "loss", borderColor: "#b3261e", backgroundColor: "#b3261e", tension: .2},
      {label: "test metric", data: [], yAxisID: "metric", borderColor: "#2f5bd3", backgroundColor: "#2f5bd3", tension: .2},
    ]},
    options: {
      animation: false, maintainAspectRatio: false, interaction: {mode: "index", intersect: false},
      scales: {
        x: {title: {display: true, text: "round"}},
        loss: {type: "linear", position: "left", title: {display: true, text: "loss"}},
        metric: {type: "linear", position: "right", title: {display: true, text: "metric"}, grid: {drawOnChartArea: false}},
      },
    },
  });

  function render() {
    const rounds = state.round_list.filter((r) => Object.keys(r.metrics).length);
    const metric = mainMetric(rounds, state.metrics);
    chart.data.labels = rounds.map((r) => r.number);
    chart.data.datasets[0].data = rounds.map((r) => r.metrics.train_loss ?? null);
    chart.data.datasets[1].data = rounds.map((r) => r.metrics.test_loss ?? null);
    chart.data.datasets[2].data = metric ? rounds.map((r) => r.metrics[metric.key] ?? null) : [];
    chart.data.datasets[2].label = metric ? metric.label : "test metric";
    chart.options.scales.metric.title.text = metric ? metric.label : "metric";
    chart.update();
    canvas.dataset.points = String(rounds.length);

    const status = document.getElementById("job-status");
    status.textContent = state.status_display;
    status.className = "status " + state.status;
    const note = document.getElementById("job-note");
    note.textContent = state.note;
    note.hidden = !state.note;
    document.getElementById("job-rounds-done").textContent = state.rounds_done;
    const last = rounds[rounds.length - 1];
    document.getElementById("job-metric").textContent =
      metric && last ? metric.label + " " + metric.format(last.metrics[metric.key]) : "–";
    if (state.money) {  // formatted as the page's server-side filters do (Muninn.figures), the exact value on hover
      const m = state.money, F = Muninn.figures, show = (id, figure) => F.show(document.getElementById(id), figure);
      show("job-hu-used", F.hu(F.huToFlops(m.hu_used)));
      show("job-hu-quoted", F.hu(F.huToFlops(m.hu_quoted)));
      show("job-charged", F.money(m.charged_nanos, m.currency));
      show("job-quoted", F.money(m.quoted_nanos, m.currency));
      show("job-released", F.money(m.released_nanos, m.currency));
    }
    document.getElementById("rounds-body").innerHTML = state.round_list.map((r) => {
      const units = Object.entries(r.units).map(([k, v]) => v + " " + k).join(", ") || "–";
      const fmt = (v, d) => (v === undefined || v === null ? "–" : v.toFixed(d));
      return "<tr><td class='num'>" + r.number + "</td><td>" + esc(r.status) + "</td><td>" + esc(units) +
        "</td><td class='num'>" + fmt(r.metrics.train_loss, 4) + "</td><td class='num'>" + fmt(r.metrics.test_loss, 4) +
        "</td><td class='num'>" + (metric && r.metrics[metric.key] !== undefined ? metric.format(r.metrics[metric.key]) : "–") +
        "</td></tr>";
    }).join("") || "<tr><td colspan='6' class='muted'>No round has opened yet.</td></tr>";
    const devices = state.devices || [];
    document.getElementById("devices-body").innerHTML = devices.map((d) =>
      "<tr><td>" + esc(d.name) + " <span class='muted small'>#" + d.device + "</span></td><td class='num'>" + d.units + "</td></tr>"
    ).join("") || "<tr><td colspan='2' class='muted'>No device's work has been accepted yet.</td></tr>";
  }

  async function poll() {
    try {
      state = await Muninn.getJson(progressUrl);
      render();
    } catch (e) { /* a missed poll is retried on the next tick */ }
    if (state.ended) {
      if (!startedEnded) window.location.reload();  // the page's actions (download) change with the ending
      return;
    }
    window.setTimeout(poll, 2000);
  }

  render();
  if (!state.ended) window.setTimeout(poll, 2000);
})();
