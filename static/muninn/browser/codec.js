// The update encoding (muninn_worker/codec.py; docs/worker-protocol.md, the result endpoint): a trained state
// travels as its float32 delta against the round's global weights, stored as fp32, fp16 or int8 (one scale per
// tensor), in safetensors with {"encoding": ...} metadata, deflated as a zlib stream. `roundtrip` is what the
// site makes of it after decoding, bit for bit: the receipt's last commitment hashes that.

import { serialize } from "./safetensors.js";

const FLOATING = new Set(["F32", "F64", "F16", "BF16"]);
const SCALE_SUFFIX = ".__scale__";
export const ENCODINGS = ["fp32", "fp16", "int8"];

const f32buf = new Float32Array(1), u32buf = new Uint32Array(f32buf.buffer);

/** float32 → IEEE half (bits), rounding to nearest even, as torch's .half(). */
export function toHalfBits(value) {
  f32buf[0] = value;
  const x = u32buf[0], sign = (x >>> 16) & 0x8000, exp = (x >>> 23) & 0xff, mant = x & 0x7fffff;
  if (exp === 0xff) return sign | 0x7c00 | (mant ? 0x200 : 0);
  const e = exp - 127 + 15;
  if (e >= 0x1f) return sign | 0x7c00;
  if (e <= 0) {
    if (e < -10) return sign;
    const m = mant | 0x800000, shift = 14 - e;
    let half = m >>> shift;
    const rest = m & ((1 << shift) - 1), mid = 1 << (shift - 1);
    if (rest > mid || (rest === mid && (half & 1))) half += 1;
    return sign | half;
  }
  let half = (e << 10) | (mant >>> 13);
  const rest = mant & 0x1fff;
  if (rest > 0x1000 || (rest === 0x1000 && (half & 1))) half += 1; // may carry into the exponent: still right
  return sign | half;
}

/** IEEE half bits → its value. */
export function fromHalfBits(h) {
  const sign = h & 0x8000 ? -1 : 1, exp = (h >>> 10) & 0x1f, mant = h & 0x3ff;
  if (exp === 0) return sign * mant * 2 ** -24;
  if (exp === 0x1f) return mant ? NaN : sign * Infinity;
  return sign * (1 + mant / 1024) * 2 ** (exp - 15);
}

function roundHalfEven(x) {
  const r = Math.round(x);
  return (Math.abs(x % 1) === 0.5 && r % 2 !== 0) ? r - 1 : r;
}

/** The encoded tensors of `trained` against `global` (both {name: tensor}, float32). */
export function encodeTensors(trained, global, encoding) {
  if (!ENCODINGS.includes(encoding)) throw new Error(`unknown encoding ${encoding}`);
  const out = {};
  for (const [name, t] of Object.entries(trained)) {
    if (!FLOATING.has(t.dtype)) { out[name] = t; continue; }
    const g = global[name].data, delta = new Float32Array(t.data.length);
    for (let i = 0; i < delta.length; i++) delta[i] = t.data[i] - g[i];
    if (encoding === "fp32") {
      out[name] = { dtype: "F32", shape: t.shape, data: delta };
    } else if (encoding === "fp16") {
      out[name] = { dtype: "F16", shape: t.shape, data: Uint16Array.from(delta, toHalfBits) };
    } else {
      let max = 0;
      for (const d of delta) max = Math.max(max, Math.abs(d));
      const scale = max > 0 ? Math.fround(max / 127) : 1;
      const q = new Int8Array(delta.length);
      for (let i = 0; i < q.length; i++) q[i] = Math.min(127, Math.max(-127, roundHalfEven(Math.fround(delta[i] / scale))));
      out[name] = { dtype: "I8", shape: t.shape, data: q };
      out[name + SCALE_SUFFIX] = { dtype: "F32", shape: [1], data: Float32Array.of(scale) };
    }
  }
  return out;
}

/** The state the site decodes from `encodeTensors`' output: float32(global) + delta′, in float32. */
export function decodeTensors(encoded, global, encoding) {
  const state = {};
  for (const [name, ref] of Object.entries(global)) {
    const v = encoded[name];
    if (!FLOATING.has(ref.dtype)) { state[name] = v; continue; }
    const out = new Float32Array(ref.data.length);
    const scale = encoding === "int8" ? encoded[name + SCALE_SUFFIX].data[0] : 1;
    for (let i = 0; i < out.length; i++) {
      const d = encoding === "fp16" ? fromHalfBits(v.data[i]) : encoding === "int8" ? Math.fround(v.data[i] * scale) : v.data[i];
      out[i] = ref.data[i] + d; // the Float32Array rounds the sum as float32 addition does
    }
    state[name] = { dtype: "F32", shape: ref.shape, data: out };
  }
  return state;
}

/** zlib (RFC 1950) of the bytes, with the browser's own CompressionStream. */
export async function deflate(bytes) {
  const stream = new Blob([bytes]).stream().pipeThrough(new CompressionStream("deflate"));
  return new Uint8Array(await new Response(stream).arrayBuffer());
}

/** The upload's bytes and the decoded state the last commitment hashes. */
export async function encodeUpdate(trained, global, encoding) {
  const encoded = encodeTensors(trained, global, encoding);
  const bytes = await deflate(serialize(encoded, { encoding }));
  return { bytes, decoded: decodeTensors(encoded, global, encoding) };
}
