// One unit's training in the browser, committed to as the reference client does (muninn_worker.segments,
// training.train_local): a checkpoint at every boundary of k steps, kept in memory until the site has said
// which segments it checks; the receipt's chain of [weights sha256, optimizer sha256]; the encoded update.

import { batchIndices, totalSteps } from "./order.js";
import { serialize } from "./safetensors.js";
import { sha256Hex } from "./bytes.js";
import { encodeUpdate } from "./codec.js";
import { MLPTrainer, shardArrays } from "./mlp.js";

export const TEMPLATES = ["mlp"];

/** [sha256 of the weights' canonical bytes, sha256 of the optimizer state's]. */
export async function commitment(weights, optimizer) {
  return [await sha256Hex(serialize(weights)), await sha256Hex(serialize(optimizer))];
}

/** A checkpoint file: the weights under weights/<name>, the optimizer state under optimizer/<name>. */
export function checkpointBytes({ weights, optimizer }) {
  const merged = {};
  for (const [k, v] of Object.entries(weights)) merged[`weights/${k}`] = v;
  for (const [k, v] of Object.entries(optimizer)) merged[`optimizer/${k}`] = v;
  return serialize(merged);
}

export function boundaries(steps, k) {
  const count = Math.max(1, Math.ceil(steps / k));
  return Array.from({ length: count + 1 }, (_, i) => Math.min(i * k, steps));
}

function nextTick() {
  return new Promise((resolve) => setTimeout(resolve, 0));
}

/** Train a claimed unit. `weights` and `shard` are parsed safetensors ({name: tensor}). `hooks.progress(done,
 * steps)` is told as steps go; `hooks.hold()` is awaited between steps (a paused page holds there). Returns
 * everything the upload and a challenge need. */
export async function trainUnit(unit, weights, shard, hooks = {}) {
  if (!TEMPLATES.includes(unit.template)) throw new Error(`this browser does not train ${unit.template} units`);
  const train = unit.train, { X, y, samples } = shardArrays(shard);
  const spec = { seed: train.seed, samples, batchSize: train.batch_size, innerSteps: train.inner_steps };
  const steps = totalSteps(samples, { epochs: train.epochs, batchSize: train.batch_size, innerSteps: train.inner_steps });
  const k = train.segment_steps || steps;
  const model = new MLPTrainer({ config: unit.model_config, weights, optimizer: train.optimizer || "sgd",
                                 lr: train.lr, momentum: train.momentum || 0 });
  const lossBefore = model.evaluate(X, y, samples);
  const checkpoints = [model.checkpoint()];
  const startedAt = new Date().toISOString();
  const started = performance.now();
  let lastYield = started;
  for (let step = 0; step < steps; step++) {
    model.step(X, y, batchIndices(step, spec));
    const done = step + 1;
    if (done % k === 0 || done === steps) checkpoints.push(model.checkpoint());
    if (performance.now() - lastYield > 50) { // let heartbeats and the page's messages through
      hooks.progress?.(done, steps);
      if (hooks.hold) await hooks.hold();
      await nextTick();
      lastYield = performance.now();
    }
  }
  const trainSeconds = (performance.now() - started) / 1000;
  const finishedAt = new Date().toISOString();
  hooks.progress?.(steps, steps);
  const lossAfter = model.evaluate(X, y, samples);
  const trained = checkpoints[checkpoints.length - 1];
  const { bytes, decoded } = await encodeUpdate(trained.weights, weights, unit.encoding);
  const chain = [];
  for (let i = 0; i < checkpoints.length - 1; i++) chain.push(await commitment(checkpoints[i].weights, checkpoints[i].optimizer));
  chain.push(await commitment(decoded, trained.optimizer));
  const finite = (v) => (Number.isFinite(v) ? v : null);
  const receipt = {
    unit: unit.id, weights_sha256: unit.weights_sha256, shard_sha256: unit.shard_sha256,
    output_sha256: await sha256Hex(bytes), samples, steps, loss_before: finite(lossBefore),
    loss_after: finite(lossAfter), started_at: startedAt, finished_at: finishedAt,
    train_seconds: Math.round(trainSeconds * 1e6) / 1e6, segment_steps: k, checkpoints: chain,
  };
  return { upload: bytes, receipt, checkpoints, steps, samples, trainSeconds, lossBefore, lossAfter };
}
