// The `mlp` template (docs/worker-protocol.md, "The mlp template" and "Determinism") in plain JavaScript.
// Weights and optimizer state are stored as float32 (Float32Array), as torch keeps them; each step computes in
// float64 and rounds the new state to float32, the arithmetic bench/verification.py calibrated the tolerances
// with (training.py's numerics="f64"), so a browser's segment lands as close to the validator's as a GPU's does.

import { f32, numel } from "./safetensors.js";

const BETA1 = 0.9, BETA2 = 0.999, EPS = 1e-8;

/** The layer sizes and task of an mlp model_config: {task, widths: [F, h1, …, out]}. */
export function architecture(config) {
  const task = config.task || "classification";
  const out = task === "regression" ? 1 : config.num_classes;
  return { task, widths: [config.in_features, ...(config.hidden || []), out] };
}

/** The trainable parameters' names, in the model's order (the ones that have optimizer state). */
export function parameterNames(config) {
  const names = [];
  for (let i = 0; i < architecture(config).widths.length - 1; i++) names.push(`layers.${2 * i}.weight`, `layers.${2 * i}.bias`);
  return names;
}

/** The optimizer state before the first step, as boundary 0 commits to it (zeros; none for plain SGD). */
export function initialOptimizerState(config, weights, optimizer, momentum) {
  const state = {};
  for (const name of parameterNames(config)) {
    const shape = weights[name].shape;
    if (optimizer === "adam") {
      state[`exp_avg:${name}`] = f32(shape);
      state[`exp_avg_sq:${name}`] = f32(shape);
      state[`step:${name}`] = f32([]);
    } else if (momentum !== 0) {
      state[`momentum_buffer:${name}`] = f32(shape);
    }
  }
  return state;
}

function copyTensors(tensors) {
  return Object.fromEntries(Object.entries(tensors).map(([k, t]) => [k, { ...t, shape: [...t.shape], data: t.data.slice() }]));
}

/** One unit's model and optimizer, trained step by step on a shard (X: Float32Array of rows × features; y:
 * Int32Array of classes or Float32Array of targets). */
export class MLPTrainer {
  constructor({ config, weights, optimizerState, optimizer = "sgd", lr, momentum = 0 }) {
    const { task, widths } = architecture(config);
    this.task = task; this.widths = widths; this.features = widths[0];
    this.optimizer = optimizer; this.lr = lr; this.momentum = momentum;
    this.weights = copyTensors(weights);
    this.state = copyTensors(optimizerState || initialOptimizerState(config, weights, optimizer, momentum));
    this.names = parameterNames(config);
    const expected = Object.keys(initialOptimizerState(config, weights, optimizer, momentum)).sort();
    if (JSON.stringify(expected) !== JSON.stringify(Object.keys(this.state).sort())) {
      throw new Error("the optimizer state does not fit this model");
    }
  }

  /** The state now: {weights, optimizer} as tensors (copies). */
  checkpoint() {
    return { weights: copyTensors(this.weights), optimizer: copyTensors(this.state) };
  }

  _W(i) { return this.weights[`layers.${2 * i}.weight`].data; }
  _b(i) { return this.weights[`layers.${2 * i}.bias`].data; }

  /** Forward over the given rows: the activations of every layer (Float64Array each, row-major). */
  _forward(X, rows) {
    const B = rows.length, F = this.features;
    const mean = this.weights.norm_mean.data, std = this.weights.norm_std.data;
    const h0 = new Float64Array(B * F);
    for (let r = 0; r < B; r++) {
      const base = rows[r] * F;
      for (let f = 0; f < F; f++) h0[r * F + f] = (X[base + f] - mean[f]) / std[f];
    }
    const acts = [h0];
    const L = this.widths.length - 1;
    for (let i = 0; i < L; i++) {
      const nin = this.widths[i], nout = this.widths[i + 1], W = this._W(i), b = this._b(i), h = acts[i];
      const z = new Float64Array(B * nout);
      for (let r = 0; r < B; r++) {
        const hr = r * nin;
        for (let o = 0; o < nout; o++) {
          let s = b[o];
          const wo = o * nin;
          for (let k = 0; k < nin; k++) s += h[hr + k] * W[wo + k];
          z[r * nout + o] = i < L - 1 && s < 0 ? 0 : s; // ReLU after every layer but the last
        }
      }
      acts.push(z);
    }
    return acts;
  }

  /** The batch's summed loss and its gradient with respect to the last layer's output. */
  _lossGrad(out, y, rows, wantGrad) {
    const B = rows.length, C = this.widths[this.widths.length - 1];
    const grad = wantGrad ? new Float64Array(B * C) : null;
    let total = 0;
    if (this.task === "regression") {
      const ts = this.weights.target_std.data[0], tm = this.weights.target_mean.data[0];
      for (let r = 0; r < B; r++) {
        const pred = out[r] * ts + tm;
        const d = pred / ts - y[rows[r]] / ts;
        total += d * d;
        if (grad) grad[r] = (2 * d / ts) * ts / B;
      }
      return { total, grad };
    }
    for (let r = 0; r < B; r++) {
      const z = out.subarray(r * C, (r + 1) * C);
      let max = -Infinity;
      for (let c = 0; c < C; c++) if (z[c] > max) max = z[c];
      let sum = 0;
      for (let c = 0; c < C; c++) sum += Math.exp(z[c] - max);
      const lse = max + Math.log(sum), target = y[rows[r]];
      total += lse - z[target];
      if (grad) {
        for (let c = 0; c < C; c++) grad[r * C + c] = (Math.exp(z[c] - lse) - (c === target ? 1 : 0)) / B;
      }
    }
    return { total, grad };
  }

  /** One optimizer step on the given rows; returns the batch's mean loss. */
  step(X, y, rows) {
    const B = rows.length, L = this.widths.length - 1;
    const acts = this._forward(X, rows);
    let { total, grad: dz } = this._lossGrad(acts[L], y, rows, true);
    const grads = {};
    for (let i = L - 1; i >= 0; i--) {
      const nin = this.widths[i], nout = this.widths[i + 1], W = this._W(i), h = acts[i];
      const gW = new Float64Array(nout * nin), gb = new Float64Array(nout);
      for (let r = 0; r < B; r++) {
        const hr = r * nin;
        for (let o = 0; o < nout; o++) {
          const d = dz[r * nout + o];
          if (d === 0) continue;
          gb[o] += d;
          const wo = o * nin;
          for (let k = 0; k < nin; k++) gW[wo + k] += d * h[hr + k];
        }
      }
      grads[`layers.${2 * i}.weight`] = gW; grads[`layers.${2 * i}.bias`] = gb;
      if (i > 0) {
        const dh = new Float64Array(B * nin);
        for (let r = 0; r < B; r++) {
          for (let o = 0; o < nout; o++) {
            const d = dz[r * nout + o];
            if (d === 0) continue;
            const wo = o * nin, hr = r * nin;
            for (let k = 0; k < nin; k++) dh[hr + k] += d * W[wo + k];
          }
        }
        for (let j = 0; j < dh.length; j++) if (!(h[j] > 0)) dh[j] = 0; // ReLU's gradient
        dz = dh;
      }
    }
    for (const name of this.names) this._update(name, grads[name]);
    return total / B;
  }

  _update(name, g) {
    const p = this.weights[name].data, lr = this.lr;
    if (this.optimizer === "adam") {
      const m = this.state[`exp_avg:${name}`].data, s = this.state[`exp_avg_sq:${name}`].data;
      const t = this.state[`step:${name}`].data;
      t[0] = t[0] + 1;
      const stepSize = lr / (1 - BETA1 ** t[0]), bc2 = Math.sqrt(1 - BETA2 ** t[0]);
      for (let j = 0; j < p.length; j++) {
        const mj = m[j] + (1 - BETA1) * (g[j] - m[j]);
        const sj = s[j] * BETA2 + (1 - BETA2) * g[j] * g[j];
        p[j] = p[j] - stepSize * mj / (Math.sqrt(sj) / bc2 + EPS);
        m[j] = mj; s[j] = sj;
      }
    } else if (this.momentum !== 0) {
      const v = this.state[`momentum_buffer:${name}`].data, mu = this.momentum;
      for (let j = 0; j < p.length; j++) {
        const vj = mu * v[j] + g[j];
        p[j] = p[j] - lr * vj;
        v[j] = vj;
      }
    } else {
      for (let j = 0; j < p.length; j++) p[j] = p[j] - lr * g[j];
    }
  }

  /** The mean loss over every row of the shard (chunked, no training). */
  evaluate(X, y, samples) {
    let total = 0;
    for (let start = 0; start < samples; start += 1024) {
      const rows = [];
      for (let r = start; r < Math.min(samples, start + 1024); r++) rows.push(r);
      const acts = this._forward(X, rows);
      total += this._lossGrad(acts[acts.length - 1], y, rows, false).total;
    }
    return total / samples;
  }
}

/** The shard's X as one float32 row per sample (images flattened in C order) and y as numbers. */
export function shardArrays(shard) {
  const X = shard.X, y = shard.y, samples = X.shape[0];
  const features = numel(X.shape.slice(1));
  const Xf = X.dtype === "F32" ? X.data : Float32Array.from(X.data, Number);
  const yv = y.dtype === "I64" ? Int32Array.from(y.data, Number) : (y.dtype === "F32" ? y.data : Float32Array.from(y.data, Number));
  return { X: Xf, y: yv, samples, features };
}
