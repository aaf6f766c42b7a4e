// The worker protocol's HTTP calls from a browser (docs/worker-protocol.md): the device token on every call,
// errors in the site's shape, network failures and 429/5xx retried with backoff and jitter.

export class ApiError extends Error {
  constructor(status, error) {
    super(error.message);
    this.status = status; this.code = error.code; this.detail = error.detail || {};
  }
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

export class WorkerApi {
  constructor(server, token) {
    this.server = server.replace(/\/$/, "");
    this.auth = `Device ${token}`;
  }

  async request(path, { method = "GET", json, form, attempts = 6 } = {}) {
    const headers = { Authorization: this.auth };
    let body;
    if (json !== undefined) { headers["Content-Type"] = "application/json"; body = JSON.stringify(json); }
    if (form !== undefined) body = form;
    for (let attempt = 1; ; attempt++) {
      let answer;
      try {
        answer = await fetch(this.server + path, { method, headers, body, credentials: "omit" });
      } catch (error) { // the network: try again
        if (attempt >= attempts) throw error;
        await sleep(Math.min(8000, 500 * 2 ** attempt) * (0.5 + Math.random()));
        continue;
      }
      if ((answer.status === 429 || answer.status >= 500) && attempt < attempts) {
        const after = Number(answer.headers.get("Retry-After"));
        await sleep(after > 0 ? after * 1000 : Math.min(8000, 500 * 2 ** attempt) * (0.5 + Math.random()));
        continue;
      }
      if (answer.status >= 400) {
        const text = await answer.text();
        let error = { code: `http_${answer.status}`, message: `The site answered ${answer.status}.` };
        try { error = JSON.parse(text).error || error; } catch (e) { /* not JSON */ }
        throw new ApiError(answer.status, error);
      }
      return answer;
    }
  }

  async json(path, options) {
    const answer = await this.request(path, options);
    return answer.status === 204 ? null : answer.json();
  }

  async bytes(path) {
    return new Uint8Array(await (await this.request(path)).arrayBuffer());
  }

  claim(wait) { return this.json("/api/worker/claim", { method: "POST", json: { wait }, attempts: 3 }); }
  me() { return this.json("/api/worker/me"); }
  giveBack(unitId) { return this.json(`/api/worker/units/${unitId}/release`, { method: "POST", attempts: 1 }); }
  heartbeat(unitId) { return this.json(`/api/worker/units/${unitId}/heartbeat`, { method: "POST", json: {}, attempts: 2 }); }

  result(unitId, upload, receiptText, signature) {
    const form = new FormData();
    form.append("weights", new Blob([upload]), "update.safetensors.zlib");
    form.append("receipt", receiptText);
    form.append("signature", signature);
    return this.json(`/api/worker/units/${unitId}/result`, { method: "POST", form });
  }

  checkpoint(unitId, boundary, bytes) {
    const form = new FormData();
    form.append("checkpoint", new Blob([bytes]), `checkpoint-${boundary}.safetensors`);
    return this.json(`/api/worker/units/${unitId}/checkpoints/${boundary}`, { method: "POST", form });
  }
}
