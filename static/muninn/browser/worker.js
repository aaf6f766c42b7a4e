// The browser's worker loop, in a Web Worker so the page stays responsive: claim → download the weights and the
// shard → train with a checkpoint at every segment boundary kept in memory → upload the encoded update with its
// signed receipt → upload the checkpoints a challenge asks for → claim again. Heartbeats keep the lease while it
// trains; a paused worker holds between steps and claims nothing. Messages to the page: {type: "status" |
// "unit" | "progress" | "done" | "me" | "error" | "probe", ...}.

import { ApiError, WorkerApi } from "./client.js";
import { sha256Hex } from "./bytes.js";
import { sign } from "./keys.js";
import { parse } from "./safetensors.js";
import { checkpointBytes, trainUnit, TEMPLATES } from "./trainer.js";
import { MLPTrainer } from "./mlp.js";

const CLAIM_WAIT = 25;
let paused = false, stopped = false, waiters = [];
const post = (message) => self.postMessage(message);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function hold() {
  return paused && !stopped ? new Promise((resolve) => waiters.push(resolve)) : null;
}

self.onmessage = (event) => {
  const message = event.data;
  if (message.type === "probe") post({ type: "probe", ...benchmark() });
  else if (message.type === "start") run(message).catch((error) => post({ type: "error", message: String(error.message || error) }));
  else if (message.type === "pause") { paused = true; post({ type: "status", text: "Paused" }); }
  else if (message.type === "resume") { paused = false; waiters.splice(0).forEach((resolve) => resolve()); }
  else if (message.type === "stop") { stopped = true; paused = false; waiters.splice(0).forEach((resolve) => resolve()); }
};

/** A short benchmark: samples/s and FLOP/s of a digits-sized mlp trained for about a third of a second. */
function benchmark() {
  const F = 64, H = 128, C = 10, B = 32, rows = 512;
  const X = new Float32Array(rows * F).map((_, i) => Math.sin(i)), y = new Int32Array(rows).map((_, i) => i % C);
  const t = (shape) => ({ dtype: "F32", shape, data: new Float32Array(shape.reduce((a, b) => a * b, 1)).map((_, i) => Math.cos(i) * 0.05) });
  const weights = { norm_mean: t([F]), norm_std: { dtype: "F32", shape: [F], data: new Float32Array(F).fill(1) },
    "layers.0.weight": t([H, F]), "layers.0.bias": t([H]), "layers.2.weight": t([C, H]), "layers.2.bias": t([C]) };
  const model = new MLPTrainer({ config: { in_features: F, num_classes: C, hidden: [H] }, weights, lr: 0.01, momentum: 0.9 });
  let samples = 0;
  const started = performance.now();
  while (performance.now() - started < 300) {
    const batch = Array.from({ length: B }, (_, i) => (samples + i) % rows);
    model.step(X, y, batch);
    samples += B;
  }
  const samplesPerS = samples / ((performance.now() - started) / 1000);
  return { samplesPerS, flopsPerS: samplesPerS * 6 * (F * H + H * C) };
}

async function run({ server, token, keyPair }) {
  const api = new WorkerApi(server, token);
  post({ type: "status", text: "Waiting for work" });
  await refresh(api);
  // The standing follows the site while the claim waits: a unit's charge posts moments after its check.
  const standing = setInterval(() => refresh(api), 5000);
  try {
    await loop(api, keyPair);
  } finally {
    clearInterval(standing);
  }
}

async function loop(api, keyPair) {
  while (!stopped) {
    if (paused) { await hold(); continue; }
    let answer;
    try {
      answer = await api.claim(CLAIM_WAIT);
    } catch (error) {
      if (error instanceof ApiError && (error.status === 401 || error.status === 403)) {
        post({ type: "error", message: error.message, code: error.code, fatal: true });
        return;
      }
      post({ type: "status", text: `Waiting for work (${error.message})` });
      await sleep(error instanceof ApiError && error.code === "lease_limit" ? 10000 : 3000);
      continue;
    }
    if (!answer || !answer.unit) continue; // nothing now (a peer check is never leased to a browser)
    try {
      await work(api, keyPair, answer.unit);
    } catch (error) {
      post({ type: "error", message: `Unit ${answer.unit.id}: ${error.message}`, code: error.code });
      post({ type: "given-up", unit: answer.unit.id });
      await sleep(2000);
    }
    await refresh(api);
  }
}

async function refresh(api) {
  try { post({ type: "me", me: await api.me() }); } catch (error) { /* shown next time */ }
}

async function download(api, path, sha256) {
  const bytes = await api.bytes(path);
  if ((await sha256Hex(bytes)) !== sha256) throw new Error(`the download of ${path} does not match its hash`);
  return parse(bytes).tensors;
}

async function work(api, keyPair, unit) {
  post({ type: "unit", unit: { id: unit.id, job: unit.job, round: unit.round, template: unit.template, samples: unit.samples } });
  if (!TEMPLATES.includes(unit.template)) throw new Error(`this browser does not train ${unit.template} units`);
  const beat = setInterval(() => api.heartbeat(unit.id).catch(() => {}), Math.max(5, unit.lease_seconds / 3) * 1000);
  let uploaded = false;
  try {
    post({ type: "status", text: `Downloading unit ${unit.id}` });
    const weights = await download(api, `/api/worker/units/${unit.id}/weights`, unit.weights_sha256);
    const shard = await download(api, `/api/worker/units/${unit.id}/shard`, unit.shard_sha256);
    post({ type: "status", text: `Training unit ${unit.id}` });
    const trained = await trainUnit(unit, weights, shard, {
      progress: (done, steps) => post({ type: "progress", done, steps }), hold,
    });
    post({ type: "status", text: `Uploading unit ${unit.id}` });
    const receiptText = JSON.stringify(trained.receipt);
    const signature = await sign(keyPair, new TextEncoder().encode(receiptText));
    uploaded = true; // from here on the site has the result (or refused it and queued the unit again)
    let answer = await api.result(unit.id, trained.upload, receiptText, signature);
    if (answer.challenge) {
      post({ type: "status", text: `Answering the check of unit ${unit.id}` });
      for (const boundary of answer.challenge.missing) {
        answer = await api.checkpoint(unit.id, boundary, checkpointBytes(trained.checkpoints[boundary]));
      }
    }
    post({ type: "done", unit: unit.id, status: answer.status, samples: trained.samples,
           samplesPerS: trained.samples * (unit.train.epochs || 1) / Math.max(trained.trainSeconds, 1e-6) });
  } catch (error) {
    if (!uploaded) await api.giveBack(unit.id).catch(() => {}); // another device takes it now, not at lease expiry
    throw error;
  } finally {
    clearInterval(beat);
  }
}
