// ditkit: show on the graph what actually ran (backend, density, cache skips, bytes moved, decode path).
//
// The server sends one `ditkit.report` websocket event per report (nodes/_common.py: send_report):
//   {node: <unique_id>, node_type, kind, summary, data}
// Runtime reports (sparse-attention run, TeaCache counters, streaming bytes, AdaLN hits) are sent by sampling
// wrappers while ANOTHER node (the sampler) executes, so the frontend drops their progress_text; this extension
// handles the event itself and keys it by the reporting ditkit node's id. The server resolves that id in the prompt
// that is running (a cached model may have been made under another id in an earlier prompt).
// A node whose output ComfyUI serves from its cache does not run again: ComfyUI resends its cached report as an
// `executed` event under the node's current id (ditkit nodes are flagged has_intermediate_output); it is shown
// with "· cached".
//
// Rendering: node.badges (functions returning LGraphBadge), SLOTS of them pushed when the node is created.
// The classic canvas draws them above the title (LGraphNode.drawBadges); Nodes 2.0 (Vue) renders the same list in NodeBadges (usePartitionedBadges drops
// index 0, the core source badge, so ours are appended after it). Clicking a badge shows the full summary.
// DitKitTeaCacheCalibrate also gets a DOM widget (both canvases): pairs collected and, after the fit, a plot of
// rescaled (fitted polynomial of the input change) vs measured output change per stream.
import { app } from "../../../scripts/app.js";
import { api } from "../../../scripts/api.js";

const EVENT = "ditkit.report";
const CALIBRATE = "DitKitTeaCacheCalibrate";
const OK = "#1d5c2e";
const WARN = "#7a5a00";
const BAD = "#7a1f1f";
const INFO = "#24405c";
const STALE = "#444444";

// Test mode (the browser tests set it before the page loads): localStorage "ditkit.testMode" = "1" or the URL
// parameter ditkit_test=1. Only then is the extension's state exposed as window.ditkit.
export const TEST_MODE_KEY = "ditkit.testMode";
export function testMode() {
  try {
    if (new URLSearchParams(globalThis.location?.search || "").get("ditkit_test") === "1") return true;
    return globalThis.localStorage?.getItem(TEST_MODE_KEY) === "1";
  } catch {
    return false;
  }
}

// node id (string) -> {reports: {kind: payload}, order: [kind], stale: bool}; payload.cached: replayed from the cache
const state = new Map();
// ids of the nodes the running prompt gets from ComfyUI's cache (execution_cached)
let cachedNow = new Set();
// the frontend's per-node text widget for progress_text (useNodeProgressText): our summaries land there
const TEXT_PREVIEW = "$$node-text-preview";
// an install-time report never replaces the run report of the same prompt (ComfyUI replays cached reports last)
const SUPERSEDED_BY = {
  install: ["run"],
  teacache_install: ["teacache"],
  teacache_calibration_install: ["teacache_calibration_progress", "teacache_calibration"],
  teacache_calibration_progress: ["teacache_calibration"],
};

const mib = (b) => (typeof b === "number" ? `${(b / 2 ** 20).toFixed(b < 2 ** 20 ? 3 : 1)} MiB` : "?");
const num = (v, d = 2) => (typeof v === "number" ? v.toFixed(d) : "n/a");
const shorten = (s, n = 48) => (s && s.length > n ? s.slice(0, n - 1) + "…" : s || "");
const sum = (o) => Object.values(o || {}).reduce((a, v) => a + (typeof v === "number" ? v : 0), 0);

// The audio stream checked while sampling (bridge/audio_watch.py): amber with the figure when a check failed.
const audioSpec = (a) => {
  if (!a) return [];
  const t = a.trajectory || {};
  const ratio = typeof t.final_jump_ratio === "number" ? t.final_jump_ratio : null;
  if (a.clean !== false) return [{ text: `audio clean · jump ${ratio === null ? "n/a" : num(ratio) + "x"}`, color: OK }];
  const why = a.nonfinite ? `${a.nonfinite} NaN/Inf` : `final jump ${ratio === null ? "inf" : num(ratio, 1)}x`;
  return [{ text: `audio: ${why}`, color: WARN }];
};

// Kinds shown as their (shortened) summary: load-time facts with no counters.
export const SUMMARY_KINDS = ["vae_load", "latent", "te_loader"];

// One payload -> [{text, color}] (compact: a badge is one line on the node).
export function badgeSpecs(p) {
  const d = p.data || {};
  switch (p.kind) {
    case "run": {  // DitKitSparseAttention, after each sampling
      const used = Object.keys(d.backends_used || {});
      const sparse = (d.calls || {}).sparse || 0;
      const dense = sum(d.calls) - sparse;
      if (!sparse) return [{ text: `VSA: no sparse call (dense ${dense})`, color: BAD }];
      const unverified = Object.keys(d.unverified_backends || {}).length > 0;  // never run anywhere before
      return [
        { text: `VSA ${used.join("+")}${unverified ? " (unverified)" : ""} ρ=${num(d.measured_density)}`,
          color: unverified ? WARN : OK },
        { text: `steps sparse ${d.steps_sparse} / dense ${d.steps_dense}` +
                (d.steps_without_attention ? ` / ${d.steps_without_attention} cache-skipped` : ""),
          color: d.steps_dense ? WARN : OK },
      ];
    }
    case "install":
      return [{ text: `VSA keep ${num((d.keep || 0) * 100, 0)}% · ${d.backend}${d.backend_unverified ? " (unverified)" : ""}`,
                color: d.backend_unverified ? WARN : INFO }];
    case "teacache": {
      const out = [{ text: `TeaCache skipped ${d.skipped}/${d.calls} (${num(d.block_eval_ratio)}x)`,
                     color: d.skipped ? OK : WARN }];
      for (const [s, st] of Object.entries(d.streams || {})) {
        out.push({ text: `${s}: ${st.computed} computed / ${st.skipped} skipped`, color: INFO });
      }
      if ((d.warnings || []).length) out.push({ text: `fingerprint: ${d.warnings.length} warning(s)`, color: WARN });
      return out.concat(audioSpec(d.audio_latent));
    }
    case "teacache_install":
      return [{ text: d.deferred ? `TeaCache: ${d.coefficients} (loaded at run)` : `TeaCache ready (${d.kind || "file"})`,
                color: (d.warnings || []).length ? WARN : INFO }];
    case "teacache_calibration": {
      if (d.fit) {
        return [{ text: "fit " + Object.entries(d.fit).map(([s, f]) => `${s} R²=${num(f.r2, 3)}`).join(", "),
                  color: OK }];
      }
      return [{ text: `calib ${d.pairs_this_run} pairs · ${d.prompts}/${d.min_prompts} prompts`, color: INFO }];
    }
    case "teacache_calibration_progress":  // optional per-step report: {pairs, step, steps}
      return [{ text: `calib recording: ${d.pairs} pairs (step ${d.step}/${d.steps})`, color: INFO }];
    case "teacache_calibration_install":
      return [{ text: `calibrating '${d.name}'`, color: INFO }];
    case "vae_decode": {
      const path = d.path || "?";
      const label = { repeat_decode: "T=1 repeat-decode", direct_image_vae: "T=1 direct (image VAE)",
                      native: "native decode" }[path] || path;
      return [{ text: `${label}${d.frames ? ` · ${d.frames} frames` : ""}`, color: path === "native" ? INFO : OK }];
    }
    case "lokr": {
      const applied = (d.applied || []).length;
      const unused = Object.keys(d.unused || {}).length;
      const refused = Object.keys(d.refused || {}).length;
      return [{ text: `LoKr ${applied} applied · ${unused} unused · ${refused} refused`,
                color: refused || unused ? WARN : OK }];
    }
    case "adapter": {  // DitKitAdapterLoader: H3 plan (qkv_layout, gates) or the LoKr plan on Z-Image / FLUX.2
      const applied = (d.applied || []).length;
      const unused = Object.keys(d.unused || {}).length;
      const refused = Object.keys(d.refused || {}).length;
      const out = [{ text: `adapter ${applied} applied · ${unused} unused · ${refused} refused`,
                     color: refused || unused ? WARN : OK }];
      if (d.qkv_layout && d.qkv_layout !== "n/a") out.push({ text: `qkv ${d.qkv_layout}`, color: INFO });
      if ((d.gates || []).length) out.push({ text: `${d.gates.length} VSA gates assigned`, color: INFO });
      return out;
    }
    case "adaln_cache": {
      if (d.run) {
        const r = d.run;
        return [{ text: `AdaLN ${r.hits} hits · ${r.misses} misses · ${r.rebuilds} rebuilds`, color: r.misses ? WARN : OK },
                { text: `tables ${mib((d.total || {}).table_bytes)}`, color: INFO }].concat(audioSpec(d.audio_latent));
      }
      return [{ text: shorten(p.summary), color: INFO }];
    }
    case "te_streaming": {
      if (d.streaming === "noop_cpu") return [{ text: "TE streaming: no-op on CPU", color: WARN }];
      return [{ text: `TE streamed ${mib(d.bytes_h2d)} · peak ${mib(d.peak_device_bytes)}`, color: OK }];
    }
    case "error":  // a ditkit node raised: the exception message (DitKitError texts say what to do)
      return [{ text: shorten(`error: ${p.summary}`, 64), color: BAD }];
    case "schedule": {  // DitKitFastH3Schedule: recipe, shifts, forwards, contract check
      const c = d.contract ? "contract ok" : "no contract";
      return [{ text: shorten(`${d.label || d.recipe} · shifts ${d.video_shift}/${d.audio_shift}`), color: OK },
              { text: `${d.forwards} forwards · ${c}`, color: d.contract ? OK : INFO }];
    }
    case "load": {  // model loaders; quantized while loading (weight_format): the format and bytes first
      const q = d.quantization;
      const out = [{ text: shorten(p.summary), color: INFO }];
      if (q && q.format) out.unshift({ text: `${q.format} weights ${mib(q.bytes_in)} → ${mib(q.bytes_out)}`, color: OK });
      return out;
    }
    case "video_save": {
      const out = [{ text: shorten(`saved ${d.frames} frames, ${d.chunks} chunks`), color: OK }];
      const g = d.audio_guard;
      if (g) out.push(g.clean ? { text: "audio guard: clean", color: OK }
                              : { text: shorten(`audio: ${(g.flags || []).join("; ")}`, 64), color: WARN });
      return out;
    }
    case "stepcache_install":
      return [{ text: shorten(`${d.mode} · thr ${Object.entries(d.thresholds || {}).map(([s, t]) => `${s} ${t}`).join(", ")}`),
                color: INFO }];
    case "stepcache": {
      const out = [{ text: `${d.mode} skipped ${d.skipped}/${d.calls} (${num(d.block_eval_ratio)}x)`,
                     color: d.skipped ? OK : WARN }];
      for (const [s, st] of Object.entries(d.streams || {})) {
        out.push({ text: `${s}: ${st.skipped} skipped · ${st.vetoes} vetoes`, color: INFO });
      }
      return out.concat(audioSpec(d.audio_latent));
    }
    case "audio_watch":  // DitKitFastH3Schedule: the audio check of a run on its schedule
      return audioSpec(d);
    case "preflight": {  // DitKitPreflight: predicted peak vs the memory available, the shortfall when short
      const gib = (b) => num((b || 0) / 1073741824);
      const out = [{ text: `predicted ${gib(d.predicted_bytes)} GiB vs ${gib(d.available_bytes)} GiB ${d.where || ""}`.trim()
                            + (d.fits ? " · fits" : ` · SHORT by ${gib(d.shortfall_bytes ?? (d.predicted_bytes - d.available_bytes))} GiB`),
                     color: d.fits ? OK : BAD }];
      if (d.tokens) out.push({ text: `${d.tokens.total} tokens`, color: INFO });
      return out;
    }
    case "activation_chunking":  // DitKitActivationChunking: feed-forward sites chunked, chunk size, head groups
      return [{ text: shorten(`${d.sites} feed-forwards chunked · ${d.chunk ? `${d.chunk} tokens` : "auto"}`
                              + (d.attention_heads_per_call ? ` · ${d.attention_heads_per_call} heads/call` : "")),
                color: d.sites ? OK : WARN }];
    default:
      return [{ text: shorten(p.summary), color: INFO }];
  }
}

function findNode(id) {
  const g = app.graph;
  if (!g || id == null) return null;
  const sid = String(id);
  let n = g.getNodeById(sid) ?? g.getNodeById(Number(sid));
  if (n) return n;
  // subgraph execution ids look like "<outer>:<inner>"
  const parts = sid.split(":");
  let graph = g;
  for (let i = 0; i < parts.length; i++) {
    n = graph?.getNodeById(parts[i]) ?? graph?.getNodeById(Number(parts[i]));
    if (!n) return null;
    if (i < parts.length - 1) graph = n.subgraph;
  }
  return n;
}

function makeBadge(text, color, onClick) {
  const B = globalThis.LGraphBadge;
  if (B) return new B({ text, fgColor: "#ffffff", bgColor: color, onClick });
  // fallback: the duck-typed shape drawBadges and the click hit-test (boundingRect, node-relative) use
  return {
    text, height: 20, fgColor: "#fff", bgColor: color, onClick, visible: Boolean(text), boundingRect: [0, 0, 0, 0],
    getWidth(ctx) { ctx.save(); ctx.font = "12px sans-serif"; const w = ctx.measureText(text).width + 12; ctx.restore(); return w; },
    draw(ctx, x, y) {
      if (!text) return;
      const w = this.getWidth(ctx);
      this.boundingRect.splice(0, 4, x, y, w, 20);
      ctx.save(); ctx.fillStyle = color; ctx.beginPath(); ctx.roundRect?.(x, y, w, 20, 5); ctx.fill();
      ctx.fillStyle = "#fff"; ctx.font = "12px sans-serif"; ctx.textBaseline = "middle"; ctx.fillText(text, x + 6, y + 11);
      ctx.restore();
    },
  };
}

const keyOf = (node) => node.ditkitKey ?? String(node.id);

function showDetails(node) {
  const s = state.get(keyOf(node));
  if (!s) return;
  const detail = s.order.map((k) => `[${k}] ${s.reports[k].summary}` +
                             (s.reports[k].cached ? " (cached output: reported when it was made)" : "")).join("\n");
  const toast = app.extensionManager?.toast;
  if (toast?.add) toast.add({ severity: "info", summary: `${node.title} (ditkit)`, detail, life: 12000 });
  else console.info(`[ditkit] ${node.title}\n${detail}`);
}

// Texts of this node's ditkit badges in display order (also used by the browser test).
export function badgeTexts(nodeId) {
  const s = state.get(String(nodeId));
  return s ? specsOf(s).map((b) => b.text) : [];
}

// A node's badges: its reports in arrival order, grey when stale, the first badge of a cached report marked.
function specsOf(s) {
  return s.order.flatMap((k) => badgeSpecs(s.reports[k]).map((b, j) => ({
    ...b, text: j === 0 && s.reports[k].cached ? `${b.text} · cached` : b.text, color: s.stale ? STALE : b.color })));
}

const SLOTS = 6;  // badge slots per ditkit node (created with the node so Nodes 2.0 tracks them)
const REV = "__ditkitReportRevision";
let rev = 0;

function currentSpecs(node) {
  const s = state.get(keyOf(node));
  return s ? specsOf(s) : [];
}

function addBadgeSlots(node) {
  if (!node.badges || node.ditkitSlots) return;
  node.ditkitSlots = true;
  for (let i = 0; i < SLOTS; i++) {
    // One memo per slot: the classic canvas draws the badge a slot returns (setting its boundingRect) and, on a
    // click, hit-tests what the slots return then; both must be the same object until a report changes it.
    let memo = null;
    const fn = () => {
      // Reading this reactive (pinia store) key makes Nodes 2.0's badge computed re-run when a report arrives;
      // the classic canvas calls these functions on every draw.
      const r = app.extensionManager?.[REV] ?? rev;
      if (!memo || memo.rev !== r) {
        const spec = currentSpecs(node)[i];
        memo = { rev: r, badge: makeBadge(spec ? spec.text : "", spec ? spec.color : STALE, () => showDetails(node)) };
      }
      return memo.badge;
    };
    fn.ditkit = i;
    node.badges.push(fn);
  }
}

function refreshBadges(node) {
  rev += 1;
  if (app.extensionManager) app.extensionManager[REV] = rev;
  addBadgeSlots(node);
  node.setDirtyCanvas?.(true, true);
  app.canvas?.setDirty?.(true, true);
}

function handleReport(p) {
  if (!p || p.node == null) return;
  const id = String(p.node);
  let s = state.get(id);
  if (!s || s.stale) {
    s = { reports: {}, order: [], stale: false };
    state.set(id, s);
  }
  if ((SUPERSEDED_BY[p.kind] || []).some((k) => k in s.reports)) return;
  if (!(p.kind in s.reports)) s.order.push(p.kind);
  s.reports[p.kind] = p;
  // an install report followed by its run report: show the run
  if (p.kind === "run") dropKind(s, "install");
  if (p.kind === "teacache") dropKind(s, "teacache_install");
  if (p.kind === "teacache_calibration_progress") dropKind(s, "teacache_calibration_install");
  if (p.kind === "teacache_calibration") {
    dropKind(s, "teacache_calibration_install");
    dropKind(s, "teacache_calibration_progress");
  }
  const node = findNode(id);
  if (!node) return;
  node.ditkitKey = id;
  refreshBadges(node);
  if (node.comfyClass === CALIBRATE || p.node_type === CALIBRATE) updateCalibrationView(node, p);
}

function dropKind(s, kind) {
  if (kind in s.reports) {
    delete s.reports[kind];
    s.order = s.order.filter((k) => k !== kind);
  }
}

// --------------------------------------------------------------------------------------- calibration view

function outputUrl(subfolder, filename) {
  const q = new URLSearchParams({ filename, subfolder, type: "output" });
  return api.apiURL(`/view?${q}`);
}

async function fetchJson(url) {
  const r = await fetch(url, { cache: "no-store" });
  if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
  return r.json();
}

function polyval(c, x) {
  return c.reduce((acc, a) => acc * x + a, 0);
}

function ensureCalibrationWidget(node) {
  if (node.ditkitCal) return node.ditkitCal;
  const root = document.createElement("div");
  root.className = "ditkit-calibration";
  root.style.cssText = "display:flex;flex-direction:column;gap:2px;font:11px sans-serif;color:#ccc;width:100%";
  const text = document.createElement("div");
  text.textContent = "calibration: waiting for a sampling run";
  const canvas = document.createElement("canvas");
  canvas.width = 260;
  canvas.height = 150;
  canvas.style.cssText = "width:100%;max-width:260px;height:auto;background:#1b1b1b;border-radius:4px;display:none";
  root.append(text, canvas);
  let widget = null;
  if (node.addDOMWidget) {
    widget = node.addDOMWidget("ditkit_calibration", "ditkit_calibration", root,
                               { serialize: false, getMinHeight: () => (node.ditkitCal?.plot ? 190 : 36),
                                 getMaxHeight: () => (node.ditkitCal?.plot ? 200 : 60) });
    if (widget) widget.serialize = false;
  }
  node.ditkitCal = { root, text, canvas, widget, plot: null };
  return node.ditkitCal;
}

function drawPlot(canvas, series) {
  // series: {stream: {points: [[rescaled, measured]...], r2}}
  const ctx = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height, pad = 24;
  ctx.clearRect(0, 0, W, H);
  let max = 0;
  for (const s of Object.values(series)) for (const [a, b] of s.points) max = Math.max(max, a, b);
  max = max > 0 ? max * 1.05 : 1;
  const X = (v) => pad + (v / max) * (W - pad - 6);
  const Y = (v) => H - pad - (v / max) * (H - pad - 6);
  ctx.strokeStyle = "#666"; ctx.lineWidth = 1;
  ctx.beginPath(); ctx.moveTo(pad, 6); ctx.lineTo(pad, H - pad); ctx.lineTo(W - 6, H - pad); ctx.stroke();
  ctx.setLineDash([3, 3]); ctx.beginPath(); ctx.moveTo(X(0), Y(0)); ctx.lineTo(X(max), Y(max)); ctx.stroke();
  ctx.setLineDash([]);
  ctx.fillStyle = "#aaa"; ctx.font = "10px sans-serif";
  ctx.fillText("rescaled p(x) →", W - 90, H - 8);
  ctx.save(); ctx.translate(10, H - pad - 4); ctx.rotate(-Math.PI / 2); ctx.fillText("measured →", 0, 0); ctx.restore();
  ctx.fillText(max.toPrecision(2), W - 30, H - pad + 12);
  const colors = ["#4fc3f7", "#ffb74d", "#aed581", "#f06292"];
  let i = 0;
  for (const [name, s] of Object.entries(series)) {
    const c = colors[i % colors.length];
    ctx.fillStyle = c;
    for (const [a, b] of s.points) { ctx.fillRect(X(a) - 1.5, Y(b) - 1.5, 3, 3); }
    ctx.fillText(`${name}${s.r2 != null ? ` R²=${s.r2.toFixed(3)}` : ""} (${s.points.length})`, pad + 4, 14 + 12 * i);
    i++;
  }
}

async function loadCalibrationPlot(p) {
  // coefficient file and this run's pair file live under <output>/ditkit/teacache/ (served by /view)
  const d = p.data || {};
  const norm = (s) => String(s).replaceAll("\\", "/");
  const coefPath = norm(d.coefficients);
  const pairPath = norm(d.pair_file || "");
  const marker = "/ditkit/teacache/";
  const ci = coefPath.lastIndexOf(marker);
  if (ci < 0) throw new Error(`coefficient file ${coefPath} is not under <output>${marker}`);
  const coef = await fetchJson(outputUrl("ditkit/teacache", coefPath.slice(ci + marker.length)));
  // every pooled run used in the fit (pair_files), else this run's file only
  const files = (Array.isArray(d.pair_files) && d.pair_files.length ? d.pair_files : [pairPath]).map(norm);
  const pooled = {};
  for (const f of files) {
    const pi = f.lastIndexOf(marker);
    if (pi < 0) continue;
    const rel = f.slice(pi + marker.length);
    const cut = rel.lastIndexOf("/");
    const one = await fetchJson(outputUrl("ditkit/teacache/" + rel.slice(0, cut), rel.slice(cut + 1)));
    for (const [stream, rows] of Object.entries(one?.pairs || {})) (pooled[stream] ||= []).push(...rows);
  }
  const series = {};
  for (const [stream, st] of Object.entries(coef.streams || {})) {
    const rows = pooled[stream] || [];
    const [lo, hi] = st.x_range || [-Infinity, Infinity];
    const points = rows.map((r) => [polyval(st.coefficients, Math.min(Math.max(r[0], lo), hi)), r[1]])
                       .filter(([a, b]) => Number.isFinite(a) && Number.isFinite(b));
    series[stream] = { points, r2: st.fit?.r2 ?? null };
  }
  return series;
}

function updateCalibrationView(node, p) {
  if (!String(p.kind).startsWith("teacache_calibration")) return;
  const cal = ensureCalibrationWidget(node);
  const d = p.data || {};
  if (p.kind === "teacache_calibration_install") {
    cal.text.textContent = `recorder installed for '${d.name}': waiting for sampling`;
    return;
  }
  if (p.kind === "teacache_calibration_progress") {
    cal.text.textContent = `recording: ${d.pairs} pairs (step ${d.step}/${d.steps})`;
    return;
  }
  cal.pairs = (cal.pairs || 0) + (d.pairs_this_run || 0);
  cal.text.textContent = `pairs this run ${d.pairs_this_run} · ${d.prompts}/${d.min_prompts} prompts · ${d.runs} run(s)` +
    (d.fit ? " · fitted" : "");
  if (!d.fit || !d.coefficients) return;
  loadCalibrationPlot(p).then((series) => {
    cal.plot = series;
    cal.canvas.style.display = "block";
    drawPlot(cal.canvas, series);
    const want = node.computeSize?.() ?? node.size;
    node.setSize?.([Math.max(node.size[0], 280, want[0]), Math.max(node.size[1], want[1])]);
    node.setDirtyCanvas?.(true, true);
  }).catch((e) => {
    cal.text.textContent += ` · plot unavailable: ${e.message}`;
  });
}

// ------------------------------------------------------------------------------------------ run events

function clearProgressText(node) {
  // the frontend keeps the last progress_text (our summary) in a text widget; a failed run must not show it
  const w = node?.widgets?.find((x) => x.name === TEXT_PREVIEW);
  if (w) w.value = "";
}

// ComfyUI sends a node's ui output (its report, also a cached one replayed for a node that did not run) as
// `executed` for the node id of the running prompt: that id, never the one inside the payload.
function handleExecuted(d) {
  const id = d?.display_node ?? d?.node;
  const reports = d?.output?.ditkit_report;
  if (id == null || !Array.isArray(reports)) return;
  for (const p of reports) {
    const s = state.get(String(id));
    if (!s || s.stale || !(p.kind in s.reports)) {
      handleReport({ ...p, node: String(id), cached: cachedNow.has(String(id)) || cachedNow.has(String(d.node)) });
    }
  }
}

// ------------------------------------------------------------------------------------------- extension

const EXTENSION = {
  name: "ditkit.reports",
  async setup() {
    api.addEventListener(EVENT, (ev) => handleReport(ev.detail));
    // a new prompt: previous reports turn grey (kept until the node reports again; cached nodes do not re-run)
    api.addEventListener("execution_start", () => {
      cachedNow = new Set();
      for (const [id, s] of state) {
        s.stale = true;
        const n = findNode(id);
        if (n) refreshBadges(n);
      }
    });
    api.addEventListener("execution_cached", (ev) => {
      cachedNow = new Set((ev.detail?.nodes || []).map(String));
    });
    api.addEventListener("executed", (ev) => handleExecuted(ev.detail));
    // a ditkit node raised: its earlier reports and report text go, its message stays on the node as a red badge
    // (ComfyUI also outlines the node and shows the error dialog; the badge survives closing it)
    api.addEventListener("execution_error", (ev) => {
      const d = ev.detail || {};
      if (!String(d.node_type || "").startsWith("DitKit")) return;
      const id = String(d.node_id);
      state.set(id, { reports: {}, order: [], stale: false });
      clearProgressText(findNode(id));
      handleReport({ node: id, node_type: d.node_type, kind: "error",
                     summary: `${String(d.exception_type || "").split(".").pop()}: ${d.exception_message}`, data: {} });
    });
    // the browser tests read the badges through window.ditkit; a normal session gets no global (comfy-test's lint)
    if (testMode()) window.ditkit = { state, badgeTexts, badgeSpecs, handleReport };
  },
  // another workflow is loaded: node ids are reused, so reports of the previous graph must not show on it
  async beforeConfigureGraph() {
    state.clear();
    cachedNow = new Set();
    rev += 1;
  },
  async nodeCreated(node) {
    if (!String(node.comfyClass || "").startsWith("DitKit")) return;
    if (node.badges && node.badges.length === 0) {
      // Nodes 2.0 hides badges[0] (where Comfy.NodeBadge puts the source badge); keep ours after it
      const placeholder = makeBadge("", STALE);
      node.badges.push(() => placeholder);
    }
    addBadgeSlots(node);
    if (node.comfyClass === CALIBRATE) ensureCalibrationWidget(node);
  },
};

// ComfyUI serves this file once per web folder it registers; a second copy (another URL of the same pack) must not
// register the extension again (the frontend refuses a duplicate name and the reports would be handled twice).
const LOADED = "__ditkitReportsLoadedFrom";
if (globalThis[LOADED]) {
  console.warn(`[ditkit] web extension already loaded from ${globalThis[LOADED]}; ignoring ${import.meta.url}`);
} else {
  globalThis[LOADED] = import.meta.url;
  app.registerExtension(EXTENSION);
}
