// The data order of a unit (docs/worker-protocol.md, "The data order"; muninn_worker/order.py): a
// Fisher–Yates shuffle driven by SplitMix64 in 64-bit unsigned arithmetic, here with BigInt so every value is
// exact. The rows of optimizer step s come from (seed, s) alone.

const MASK = (1n << 64n) - 1n;
const GOLDEN = 0x9E3779B97F4A7C15n;
const MIX1 = 0xBF58476D1CE4E5B9n;
const MIX2 = 0x94D049BB133111EBn;

const cache = new Map(); // the last few permutations, as the reference client keeps them

/** The shard's order in `epoch` (0-based) for this unit's `seed`: an Int32Array of n row indices. */
export function permutation(seed, epoch, n) {
  const key = `${seed}:${epoch}:${n}`;
  if (cache.has(key)) return cache.get(key);
  let state = (BigInt(seed) * GOLDEN + BigInt(epoch) + 1n) & MASK;
  const perm = new Int32Array(n);
  for (let i = 0; i < n; i++) perm[i] = i;
  for (let i = n - 1; i > 0; i--) {
    state = (state + GOLDEN) & MASK;
    let z = state;
    z = ((z ^ (z >> 30n)) * MIX1) & MASK;
    z = ((z ^ (z >> 27n)) * MIX2) & MASK;
    z ^= z >> 31n;
    const j = Number(z % BigInt(i + 1));
    const t = perm[i]; perm[i] = perm[j]; perm[j] = t;
  }
  cache.set(key, perm);
  if (cache.size > 8) cache.delete(cache.keys().next().value);
  return perm;
}

/** Optimizer steps of a unit: epochs × ceil(samples / batch), or exactly DiLoCo's `innerSteps`. */
export function totalSteps(samples, { epochs, batchSize, innerSteps = null }) {
  return innerSteps != null ? innerSteps : epochs * Math.ceil(samples / batchSize);
}

/** The shard rows of optimizer step `step` (0-based), as muninn_worker.order.batch_indices. */
export function batchIndices(step, { seed, samples, batchSize, innerSteps = null }) {
  if (innerSteps == null) {
    const perEpoch = Math.ceil(samples / batchSize);
    const epoch = Math.floor(step / perEpoch), position = step % perEpoch;
    return Array.from(permutation(seed, epoch, samples).subarray(position * batchSize, (position + 1) * batchSize));
  }
  const batch = Math.min(batchSize, samples), rows = [];
  for (let at = step * batch; at < step * batch + batch; at++) {
    rows.push(permutation(seed, Math.floor(at / samples), samples)[at % samples]);
  }
  return rows;
}
