// Safetensors in the browser (docs/worker-protocol.md, "Bytes and hashes"): read any file the site sends, and
// write the canonical bytes every commitment hashes, exactly as `safetensors.torch.save(tensors)` does.
// A tensor here is {dtype: "F32" | "I64" | ..., shape: [..], data: a typed array of its values}.

const ARRAYS = {
  F64: Float64Array, F32: Float32Array, F16: Uint16Array, BF16: Uint16Array, I64: BigInt64Array,
  I32: Int32Array, I16: Int16Array, I8: Int8Array, U8: Uint8Array, BOOL: Uint8Array,
};
// The canonical layout: by dtype (largest alignment first, as safetensors sorts them), then by name.
const DTYPE_ORDER = ["I64", "F64", "F32", "I32", "BF16", "F16", "I16", "I8", "U8", "BOOL"];

export class NotSafetensors extends Error {}

/** Parse safetensors bytes: {tensors: {name: tensor}, metadata: {...} | null}. */
export function parse(bytes) {
  const buf = bytes instanceof Uint8Array ? bytes : new Uint8Array(bytes);
  if (buf.length < 8) throw new NotSafetensors("too short to be safetensors");
  const view = new DataView(buf.buffer, buf.byteOffset, buf.byteLength);
  const n = Number(view.getBigUint64(0, true));
  if (n > buf.length - 8 || n > 100 * 1024 * 1024) throw new NotSafetensors("header length past the end");
  const header = JSON.parse(new TextDecoder().decode(buf.subarray(8, 8 + n)));
  const data = buf.subarray(8 + n);
  const tensors = {};
  for (const [name, info] of Object.entries(header)) {
    if (name === "__metadata__") continue;
    const Array_ = ARRAYS[info.dtype];
    if (!Array_) throw new NotSafetensors(`unknown dtype ${info.dtype}`);
    const [begin, end] = info.data_offsets;
    const copy = data.slice(begin, end); // a fresh, aligned buffer
    tensors[name] = { dtype: info.dtype, shape: info.shape, data: new Array_(copy.buffer) };
  }
  return { tensors, metadata: header.__metadata__ || null };
}

function compareNames(a, b) {
  return a < b ? -1 : a > b ? 1 : 0; // names are ASCII: code-unit order is byte order
}

/** The safetensors bytes of `tensors` (a {name: tensor} object): canonical when `metadata` is null. */
export function serialize(tensors, metadata = null) {
  const names = Object.keys(tensors).sort((a, b) => (
    DTYPE_ORDER.indexOf(tensors[a].dtype) - DTYPE_ORDER.indexOf(tensors[b].dtype)) || compareNames(a, b));
  const header = {};
  if (metadata) header.__metadata__ = Object.fromEntries(Object.entries(metadata).sort(([a], [b]) => compareNames(a, b)));
  let offset = 0;
  for (const name of names) {
    const { dtype, shape, data } = tensors[name];
    header[name] = { dtype, shape: Array.from(shape), data_offsets: [offset, offset + data.byteLength] };
    offset += data.byteLength;
  }
  let text = JSON.stringify(names.length || metadata ? header : {});
  text += " ".repeat((8 - (new TextEncoder().encode(text).length % 8)) % 8);
  const headerBytes = new TextEncoder().encode(text);
  const out = new Uint8Array(8 + headerBytes.length + offset);
  new DataView(out.buffer).setBigUint64(0, BigInt(headerBytes.length), true);
  out.set(headerBytes, 8);
  let at = 8 + headerBytes.length;
  for (const name of names) {
    const { data } = tensors[name];
    out.set(new Uint8Array(data.buffer, data.byteOffset, data.byteLength), at);
    at += data.byteLength;
  }
  return out;
}

/** How many values a tensor of this shape holds. */
export function numel(shape) {
  return shape.reduce((a, b) => a * b, 1);
}

export function f32(shape, data = null) {
  return { dtype: "F32", shape: Array.from(shape), data: data || new Float32Array(numel(shape)) };
}
