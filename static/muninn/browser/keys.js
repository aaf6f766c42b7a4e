// The device's Ed25519 key pair, made with WebCrypto: the private key is not extractable and stays in this
// browser's IndexedDB (structured clone keeps a CryptoKey as it is); the site only ever sees the public key.

import { base64 } from "./bytes.js";

const DB = "muninn-device", STORE = "device";

export async function newKeyPair() {
  return crypto.subtle.generateKey({ name: "Ed25519" }, false, ["sign", "verify"]);
}

/** base64 of the 32 raw bytes of the public key, as registration takes it. */
export async function publicKeyBase64(keyPair) {
  return base64(await crypto.subtle.exportKey("raw", keyPair.publicKey));
}

/** base64 of the Ed25519 signature of `bytes` (a receipt's exact UTF-8 bytes). */
export async function sign(keyPair, bytes) {
  return base64(await crypto.subtle.sign({ name: "Ed25519" }, keyPair.privateKey, bytes));
}

function open() {
  return new Promise((resolve, reject) => {
    const request = indexedDB.open(DB, 1);
    request.onupgradeneeded = () => request.result.createObjectStore(STORE);
    request.onsuccess = () => resolve(request.result);
    request.onerror = () => reject(request.error);
  });
}

function run(mode, action) {
  return open().then((db) => new Promise((resolve, reject) => {
    const tx = db.transaction(STORE, mode), request = action(tx.objectStore(STORE));
    tx.oncomplete = () => { db.close(); resolve(request.result); };
    tx.onerror = () => { db.close(); reject(tx.error); };
  }));
}

/** The registered device kept for `server` ({deviceId, token, name, keyPair, ...}), or undefined. */
export function loadDevice(key) {
  return run("readonly", (store) => store.get(key));
}

export function saveDevice(key, device) {
  return run("readwrite", (store) => store.put(device, key));
}

export function forgetDevice(key) {
  return run("readwrite", (store) => store.delete(key));
}
