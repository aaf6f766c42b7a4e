// /contribute/browser/: register this browser as a device (once: the key pair and the device token stay in this
// browser's IndexedDB), probe it, and run the worker loop (worker.js) in a Web Worker, showing its progress and
// the device's earnings. Closing the tab stops the worker and gives back the unit it held (POST .../release), so
// another device takes it at once.

import { loadDevice, newKeyPair, publicKeyBase64, saveDevice, forgetDevice } from "./keys.js";

const root = document.getElementById("browser-contributor");
const $ = (id) => document.getElementById(id);
const server = location.origin;
const storageKey = `${server}|${root.dataset.user}`;
let worker = null, paused = false, unitsDone = 0, deviceToken = null, unitInHand = null;

function show(id, text) { $(id).textContent = text; }

function probe() {
  const memoryGb = navigator.deviceMemory || 2; // a rounded hint (at most 8): the site caps a browser's units anyway
  return { cores: navigator.hardwareConcurrency || 1, ramBytes: Math.round(memoryGb * 2 ** 30), webgpu: "gpu" in navigator };
}

async function register(found, bench) {
  const keyPair = await newKeyPair();
  const answer = await fetch("/api/worker/devices", {
    method: "POST", credentials: "omit",
    headers: { Authorization: `Token ${root.dataset.token}`, "Content-Type": "application/json" },
    body: JSON.stringify({
      name: `${root.dataset.user}-browser-${Math.random().toString(36).slice(2, 7)}`,
      capabilities: { cpu_cores: found.cores, ram_bytes: found.ramBytes, backends: ["browser"],
                      torch_version: "none (browser)", samples_per_s: bench.samplesPerS, flops_per_s: bench.flopsPerS },
      public_key: await publicKeyBase64(keyPair),
    }),
  });
  const body = await answer.json();
  if (answer.status !== 201) throw new Error(body.error ? body.error.message : `registration answered ${answer.status}`);
  const device = { deviceId: body.device_id, token: body.device_token, name: body.name, keyPair };
  await saveDevice(storageKey, device);
  return device;
}

async function stillRegistered(device) {
  const answer = await fetch("/api/worker/me", { headers: { Authorization: `Device ${device.token}` }, credentials: "omit" });
  return answer.status !== 401;
}

function onMessage(event) {
  const m = event.data;
  if (m.type === "status") show("browser-status", m.text);
  else if (m.type === "unit") {
    unitInHand = m.unit.id;
    show("unit-in-progress", `Unit ${m.unit.id} of job ${m.unit.job}, round ${m.unit.round} (${m.unit.template}, ${m.unit.samples} samples)`);
    $("unit-progress").value = 0;
  } else if (m.type === "progress") {
    $("unit-progress").max = m.steps; $("unit-progress").value = m.done;
    show("unit-steps", `${m.done} / ${m.steps} steps`);
  } else if (m.type === "done" || m.type === "given-up") {
    unitInHand = null;
    if (m.type === "given-up") return;
    unitsDone += 1;
    show("units-done", String(unitsDone));
    const outcome = m.status === "pending" ? "uploaded, its check is running" : m.status;
    show("last-result", `Unit ${m.unit}: ${outcome} · ${Math.round(m.samplesPerS).toLocaleString()} samples/s`);
    show("unit-in-progress", "None");
    if (!paused) show("browser-status", "Waiting for work");
  } else if (m.type === "me") {
    const me = m.me;
    show("earned-today", me.today.earned);
    show("earnings-pending", me.earnings.pending);
    show("earnings-available", me.earnings.available);
    show("verified-total", String(me.reputation.verified_total));
    show("results-today", `${me.today.accepted} accepted · ${me.today.pending} pending · ${me.today.rejected} rejected`);
    root.dataset.verified = String(me.reputation.verified_total);
    root.dataset.earnedNanos = String(me.today.earned_nanos);
    if (me.reputation.quarantined) show("browser-status", `Quarantined: ${me.reputation.quarantine_reason}`);
  } else if (m.type === "error") {
    show("browser-error", m.message);
    if (m.fatal) { show("browser-status", "Stopped"); root.dataset.state = "stopped"; }
  }
}

async function start() {
  const found = probe();
  show("probe-cores", String(found.cores));
  show("probe-memory", `${(found.ramBytes / 2 ** 30).toFixed(0)} GB (the browser's hint)`);
  show("probe-webgpu", found.webgpu ? "available (not used yet: training runs on the CPU)" : "not available");
  worker = new Worker(root.dataset.worker, { type: "module" });
  worker.onmessage = onMessage;
  const bench = await new Promise((resolve) => {
    worker.onmessage = (event) => { if (event.data.type === "probe") { worker.onmessage = onMessage; resolve(event.data); } };
    worker.postMessage({ type: "probe" });
  });
  show("probe-speed", `${Math.round(bench.samplesPerS).toLocaleString()} samples/s (a digits-sized mlp)`);
  let device = await loadDevice(storageKey);
  if (device && !(await stillRegistered(device))) { await forgetDevice(storageKey); device = undefined; }
  if (!device) {
    show("browser-status", "Registering this browser");
    device = await register(found, bench);
  }
  show("device-name", `${device.name} (#${device.deviceId})`);
  root.dataset.device = String(device.deviceId);
  root.dataset.state = "running";
  deviceToken = device.token;
  worker.postMessage({ type: "start", server, token: device.token, keyPair: device.keyPair });
}

$("pause-button").addEventListener("click", () => {
  paused = !paused;
  worker?.postMessage({ type: paused ? "pause" : "resume" });
  $("pause-button").textContent = paused ? "Resume" : "Pause";
  root.dataset.state = paused ? "paused" : "running";
  if (!paused) show("browser-status", "Resumed");
});

// Closing the tab ends the worker and gives back the unit in hand: `keepalive` lets the request outlive the page.
addEventListener("pagehide", () => {
  worker?.postMessage({ type: "stop" });
  worker?.terminate();
  if (unitInHand !== null && deviceToken) {
    fetch(`/api/worker/units/${unitInHand}/release`, {
      method: "POST", keepalive: true, credentials: "omit", headers: { Authorization: `Device ${deviceToken}` },
    }).catch(() => {});
    unitInHand = null;
  }
});

start().catch((error) => { show("browser-error", String(error.message || error)); show("browser-status", "Stopped"); root.dataset.state = "stopped"; });
