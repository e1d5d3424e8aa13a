'use strict';
// Perfetto's trace processor (the WebAssembly build its UI runs) under Node, offline:
// what tools/perfetto_check.py runs. usage: node _perfetto_tp.js UI_DIR TRACE.json < queries
// (a JSON list of SQL) -> {"results": [{"columns": [...], "rows": [[...]...], "error": ""}...]}
const fs = require('fs'), path = require('path'), vm = require('vm');
const [dir, tracePath] = process.argv.slice(2);
const queries = JSON.parse(fs.readFileSync(0, 'utf8'));
const ctx = vm.createContext({
  console: {log() {}, warn() {}, error() {}, info() {}, debug() {}},
  WorkerGlobalScope: function () {}, location: {href: 'http://localhost/'},
  setTimeout, clearTimeout, performance, TextDecoder, TextEncoder, URL,
  readFile: (name) => { const b = fs.readFileSync(path.join(dir, name));
                        return b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength); },
  traceBytes: (() => { const b = fs.readFileSync(tracePath);
                       return b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength); })(),
  queries, done: (out) => { fs.writeSync(1, JSON.stringify(out)); process.exit(0); },
  fail: (msg) => { process.stderr.write(msg + '\n'); process.exit(2); },
});
vm.runInContext(`
var self = globalThis;
// the engine loads its WebAssembly with a synchronous request (as in a web worker)
globalThis.XMLHttpRequest = class { open(m, url) { this.url = String(url); }
  send() { this.status = 200; this.response = readFile(this.url.split('/').pop()); } };
`, ctx);
try {
  vm.runInContext(fs.readFileSync(path.join(dir, 'engine_bundle.js'), 'utf8'), ctx);
} catch (e) { process.stderr.write('cannot start the trace processor: ' + String(e && e.message).slice(0, 300) + '\n'); process.exit(2); }
vm.runInContext(`
function varint(out, v) { v = BigInt(v); while (v >= 128n) { out.push(Number(v & 127n) | 128); v >>= 7n; } out.push(Number(v)); }
function field(out, num, bytes) { varint(out, num * 8 + 2); varint(out, bytes.length); for (const b of bytes) out.push(b); }
function rpc(seq, method, extra) {
  const m = []; varint(m, 8); varint(m, seq); varint(m, 16); varint(m, method);
  if (extra) field(m, extra[0], extra[1]);
  const s = []; field(s, 1, m); return new Uint8Array(s);
}
function reader(buf) {
  let p = 0;
  const rv = () => { let r = 0n, s = 0n; for (;;) { const b = buf[p++]; r |= BigInt(b & 127) << s; s += 7n; if (b < 128) return r; } };
  return { more: () => p < buf.length, next() {
    const k = Number(rv()), num = k >> 3, wt = k & 7;
    if (wt === 0) return [num, rv()];
    if (wt === 1) { const v = new DataView(buf.buffer, buf.byteOffset + p, 8).getFloat64(0, true); p += 8; return [num, v]; }
    if (wt === 2) { const n = Number(rv()); const v = buf.subarray(p, p + n); p += n; return [num, v]; }
    if (wt === 5) { p += 4; return [num, 0]; }
    throw new Error('wire type ' + wt);
  }};
}
const dec = new TextDecoder();
let pending = new Uint8Array(0), current = null, seq = 0;
const port = { onmessage: null, postMessage(data) {
  const all = new Uint8Array(pending.length + data.length); all.set(pending); all.set(data, pending.length);
  // the stream: field 1 messages, possibly split across replies
  let p = 0;
  for (;;) {
    const start = p; if (p >= all.length) { pending = new Uint8Array(0); break; }
    let k = 0, s = 0, b; do { if (p >= all.length) break; b = all[p++]; k |= (b & 127) << s; s += 7; } while (b >= 128);
    let n = 0; s = 0; do { if (p >= all.length) { b = -1; break; } b = all[p++]; n += (b & 127) * 2 ** s; s += 7; } while (b >= 128);
    if (b === -1 || p + n > all.length) { pending = all.slice(start); break; }
    onRpc(all.subarray(p, p + n)); p += n;
  }
}};
function onRpc(msg) {
  const r = reader(msg);
  while (r.more()) { const [num, v] = r.next();
    if (num === 203) onQueryResult(v); else if (num === 5) fail('fatal: ' + dec.decode(v));
    else if (num === 201 && current) { const q = reader(v); while (q.more()) { const [n2, e] = q.next(); if (n2 === 2) current.error = dec.decode(e); } }
  }
}
function onQueryResult(v) {
  const r = reader(v); let last = false;
  while (r.more()) { const [num, x] = r.next();
    if (num === 1) current.columns.push(dec.decode(x));
    else if (num === 2) current.error = dec.decode(x);
    else if (num === 3) last = onBatch(x) || last;
  }
}
function onBatch(b) {
  const r = reader(b); let cells = [], ints = [], floats = [], strs = [], blobs = 0, last = false;
  while (r.more()) { const [num, x] = r.next();
    if (num === 6) last = x !== 0n;
    if (num === 1) { let p = 0; while (p < x.length) { let v = 0, s = 0, c; do { c = x[p++]; v |= (c & 127) << s; s += 7; } while (c >= 128); cells.push(v); } }
    else if (num === 2) { const q = reader(x); let p = 0; while (p < x.length) { let v = 0n, s = 0n, c; do { c = x[p++]; v |= BigInt(c & 127) << s; s += 7n; } while (c >= 128); ints.push(BigInt.asIntN(64, v)); } }
    else if (num === 3) { const dv = new DataView(x.buffer, x.byteOffset, x.length); for (let p = 0; p < x.length; p += 8) floats.push(dv.getFloat64(p, true)); }
    else if (num === 5) { strs = dec.decode(x).split('\\0'); }
  }
  const n = current.columns.length; let row = [], ii = 0, fi = 0, si = 0;
  for (const c of cells) {
    row.push(c === 1 ? null : c === 2 ? Number(ints[ii++]) : c === 3 ? floats[fi++] : c === 4 ? strs[si++] : null);
    if (row.length === n) { current.rows.push(row); row = []; }
  }
  return last;
}
function call(method, extra) {
  // the engine answers within the call (one thread): every reply is in when it returns
  current = {columns: [], rows: [], error: '', resolve() {}};
  const c = current;
  port.onmessage({data: rpc(++seq, method, extra)});
  current = null;
  return c;
}
(async () => {
  self.onmessage({data: port});
  await new Promise((r) => setTimeout(r, 0));    // the bridge's rpc_init, a microtask
  const data = new Uint8Array(traceBytes);
  for (let o = 0; o < data.length; o += 8 << 20) call(1, [101, data.subarray(o, o + (8 << 20))]);
  call(2, null);
  const results = [];
  for (const sql of queries) {
    const q = []; field(q, 1, new TextEncoder().encode(sql));
    const r = call(3, [103, q]);
    results.push({columns: r.columns, rows: r.rows, error: r.error});
  }
  done({results});
})().catch((e) => fail(String(e && e.message || e).slice(0, 2000)));
`, ctx);
