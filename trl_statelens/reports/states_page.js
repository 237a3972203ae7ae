"use strict";
const DATA = JSON.parse(document.getElementById("data").textContent);
const SOURCES = DATA.sources;
const TEACHERS = DATA.teachers;  // the teachers that answered rows, with several; empty otherwise
const SOURCE_COLORS = {dataset: "#4e79a7", learner: "#59a14f", teacher: "#f28e2b"};
const SOURCE_TINTS = {dataset: "#b9cfe6", learner: "#bfe0b8", teacher: "#fbd0a6"};  // token backgrounds
const RUN_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"];
const TEACHER_RGB = [[225, 87, 89], [118, 183, 178], [237, 201, 72], [176, 122, 161], [156, 117, 95], [186, 176, 172]];
const PAGE_SIZE = 40;
const SVG_NS = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);

window.addEventListener("error", (event) => {  // shown on the page, so a broken view is never silent
  const box = $("errors"); box.hidden = false; box.textContent += "error: " + event.message + "\n";
});

// per-token quantities the tokens can be coloured by: value(seq, i), and a scale
function logpOf(seq, i) { return seq.lp[i]; }
function teacherOf(seq, i) { return seq.tl ? seq.tl[i] : null; }
function gapOf(seq, i) {
  const t = teacherOf(seq, i), l = seq.lp[i];
  return t === null || l === null ? null : l - t;
}
function weightOf(seq, i) { return Array.isArray(seq.w) ? seq.w[i] : seq.w; }
function entropyOf(seq, i) { return seq.en[i]; }
function prefixOf(seq, i) { return Array.isArray(seq.pl) ? seq.pl[i] : seq.pl + i; }
const QUANTITIES = {
  source: {label: "state source", value: null},
  logp: {label: "learner log p", value: logpOf, kind: "logp"},
  teacher: {label: "teacher log p", value: teacherOf, kind: "logp"},
  gap: {label: "gap log p_S - log p_T", value: gapOf, kind: "diverging"},
  weight: {label: "weight / advantage", value: weightOf, kind: "diverging"},
  entropy: {label: "learner entropy", value: entropyOf, kind: "entropy"},
};
if (TEACHERS.length) QUANTITIES.teacher_id = {label: "teacher (which one)", value: null};
const SORTS = {
  step: {label: "step", key: (s) => s.s, descending: false},
  gap: {label: "off-policy gap (highest first)", key: (s) => s.gap, descending: true},
  kl: {label: "teacher KL (highest first; learner states)", key: (s) => s.kl, descending: true},
  reward: {label: "reward (highest first)", key: (s) => s.rw, descending: true},
};

// colour scales: the domain of each quantity over every embedded token (98th percentile, so outliers saturate)
function quantile(values, q) {
  if (!values.length) return 1;
  const sorted = Float64Array.from(values).sort();
  return sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))];
}
const DOMAINS = {};
for (const [name, quantity] of Object.entries(QUANTITIES)) {
  if (!quantity.value) continue;
  const values = [];
  for (const seq of DATA.sequences) {
    for (let i = 0; i < seq.lp.length; i++) {
      const v = quantity.value(seq, i);
      if (v !== null) values.push(quantity.kind === "logp" ? -v : Math.abs(v));
    }
  }
  DOMAINS[name] = values.length ? Math.max(quantile(values, 0.98), 1e-6) : null;
}
function mix(a, b, t) {  // colours as [r, g, b]
  return "rgb(" + a.map((x, k) => Math.round(x + (b[k] - x) * t)).join(",") + ")";
}
const WHITE = [255, 255, 255], RED = [214, 39, 40], BLUE = [33, 102, 172], PURPLE = [106, 61, 154];
function colorFor(name, v) {
  if (v === null || v === undefined) return "#e6e6e6";
  const domain = DOMAINS[name], kind = QUANTITIES[name].kind;
  if (kind === "logp") return mix(WHITE, RED, Math.min(1, -v / domain));  // unlikely tokens red
  if (kind === "entropy") return mix(WHITE, PURPLE, Math.min(1, v / domain));
  const t = Math.max(-1, Math.min(1, v / domain));  // diverging: negative blue, positive red
  return t < 0 ? mix(WHITE, BLUE, -t) : mix(WHITE, RED, t);
}
function teacherColor(name, t) {  // a teacher's colour, mixed with white by t (token backgrounds are tints)
  const k = TEACHERS.indexOf(name);
  return k < 0 ? "#ddd" : mix(TEACHER_RGB[k % TEACHER_RGB.length], WHITE, t);
}
function tokenColor(seq, i) {
  if (state.color === "source") return SOURCE_TINTS[SOURCES[seq.src]] || "#ddd";
  if (state.color === "teacher_id") return teacherColor(seq.te, 0.55);
  return colorFor(state.color, QUANTITIES[state.color].value(seq, i));
}

// ----- state: filters, kept in the URL fragment --------------------------------------------------------------
const state = {runs: new Set(DATA.runs.map((_, i) => i)), stepMin: null, stepMax: null,
  sources: new Set(SOURCES), teachers: new Set(TEACHERS), rewardMin: null, rewardMax: null, color: "source",
  sort: "step", page: 0};
const DEFAULTS = JSON.stringify({...state, runs: [...state.runs], sources: [...state.sources],
  teachers: [...state.teachers]});
function readHash() {  // the filters the fragment names; the others at their defaults
  Object.assign(state, JSON.parse(DEFAULTS));
  state.runs = new Set(state.runs); state.sources = new Set(state.sources); state.teachers = new Set(state.teachers);
  const params = new URLSearchParams(location.hash.slice(1));
  const num = (v) => (v === null || v === "" || isNaN(Number(v)) ? null : Number(v));
  if (params.has("runs")) state.runs = new Set(params.get("runs").split(",").map(Number));
  if (params.has("source")) state.sources = new Set(params.get("source").split(",").filter((s) => SOURCES.includes(s)));
  if (params.has("teacher")) state.teachers = new Set(params.get("teacher").split(",").filter((t) => TEACHERS.includes(t)));
  if (params.has("steps")) {
    const [a, b] = params.get("steps").split("-");
    state.stepMin = num(a); state.stepMax = num(b);
  }
  if (params.has("reward")) {
    const [a, b] = params.get("reward").split(":");
    state.rewardMin = num(a); state.rewardMax = num(b);
  }
  if (QUANTITIES[params.get("color")]) state.color = params.get("color");
  if (SORTS[params.get("sort")]) state.sort = params.get("sort");
  if (params.has("page")) state.page = Math.max(0, num(params.get("page")) || 0);
}
function writeHash() {
  const params = new URLSearchParams();
  if (state.runs.size !== DATA.runs.length) params.set("runs", [...state.runs].join(","));
  if (state.sources.size !== SOURCES.length) params.set("source", [...state.sources].join(","));
  if (state.teachers.size !== TEACHERS.length) params.set("teacher", [...state.teachers].join(","));
  if (state.stepMin !== null || state.stepMax !== null) params.set("steps", (state.stepMin ?? "") + "-" + (state.stepMax ?? ""));
  if (state.rewardMin !== null || state.rewardMax !== null) params.set("reward", (state.rewardMin ?? "") + ":" + (state.rewardMax ?? ""));
  if (state.color !== "source") params.set("color", state.color);
  if (state.sort !== "step") params.set("sort", state.sort);
  if (state.page) params.set("page", state.page);
  history.replaceState(null, "", "#" + params.toString());
}

function visibleSequences() {
  const keep = DATA.sequences.filter((s) =>
    state.runs.has(s.r) && state.sources.has(SOURCES[s.src]) &&
    // a sequence without a teacher (a run of one teacher) shows while no teacher is unticked
    (state.teachers.size === TEACHERS.length || state.teachers.has(s.te)) &&
    (state.stepMin === null || s.s >= state.stepMin) && (state.stepMax === null || s.s <= state.stepMax) &&
    (state.rewardMin === null || (s.rw !== null && s.rw >= state.rewardMin)) &&
    (state.rewardMax === null || (s.rw !== null && s.rw <= state.rewardMax)));
  const sort = SORTS[state.sort];
  return keep.sort((a, b) => {  // missing values last
    const x = sort.key(a), y = sort.key(b);
    if (x === null || y === null) return (x === null) - (y === null);
    return sort.descending ? y - x : x - y;
  });
}

// ----- controls ------------------------------------------------------------------------------------------------
function checkbox(parent, label, checked, onChange, color) {
  const wrap = document.createElement("label");
  const box = document.createElement("input");
  box.type = "checkbox"; box.checked = checked;
  box.addEventListener("change", () => onChange(box.checked));
  wrap.append(box);
  if (color) { const sw = document.createElement("span"); sw.className = "swatch"; sw.style.background = color; wrap.append(sw, " "); }
  wrap.append(label);
  parent.append(wrap);
  return box;
}
function toggle(set, value, on) { if (on) set.add(value); else set.delete(value); }
function setupControls() {
  DATA.runs.forEach((run, i) => checkbox($("run-boxes"), run.label, state.runs.has(i),
    (on) => { toggle(state.runs, i, on); update(true); }, RUN_COLORS[i % RUN_COLORS.length]));
  SOURCES.forEach((source) => checkbox($("source-boxes"), source, state.sources.has(source),
    (on) => { toggle(state.sources, source, on); update(true); }, SOURCE_COLORS[source]));
  $("teacher-field").hidden = !TEACHERS.length;
  TEACHERS.forEach((name) => checkbox($("teacher-boxes"), name, state.teachers.has(name),
    (on) => { toggle(state.teachers, name, on); update(true); }, teacherColor(name, 0)));
  for (const [id, key] of [["step-min", "stepMin"], ["step-max", "stepMax"], ["reward-min", "rewardMin"], ["reward-max", "rewardMax"]]) {
    const input = $(id);
    input.value = state[key] ?? "";
    input.addEventListener("input", () => { state[key] = input.value === "" ? null : Number(input.value); update(true); });
  }
  $("step-clear").addEventListener("click", () => setSteps(null, null));
  for (const [id, options, key] of [["color-by", QUANTITIES, "color"], ["sort-by", SORTS, "sort"]]) {
    const select = $(id);
    for (const [name, option] of Object.entries(options)) select.add(new Option(option.label, name));
    select.value = state[key];
    select.addEventListener("change", () => { state[key] = select.value; update(key === "sort"); });
  }
  $("prev").addEventListener("click", () => { state.page--; update(false); });
  $("next").addEventListener("click", () => { state.page++; update(false); });
}
function syncControls() {  // the form shows the state (after a fragment change)
  $("run-boxes").querySelectorAll("input").forEach((box, i) => { box.checked = state.runs.has(i); });
  $("source-boxes").querySelectorAll("input").forEach((box, i) => { box.checked = state.sources.has(SOURCES[i]); });
  $("teacher-boxes").querySelectorAll("input").forEach((box, i) => { box.checked = state.teachers.has(TEACHERS[i]); });
  for (const [id, key] of [["step-min", "stepMin"], ["step-max", "stepMax"], ["reward-min", "rewardMin"], ["reward-max", "rewardMax"]]) $(id).value = state[key] ?? "";
  $("color-by").value = state.color; $("sort-by").value = state.sort;
}
function setSteps(min, max) {
  state.stepMin = min; state.stepMax = max;
  $("step-min").value = min ?? ""; $("step-max").value = max ?? "";
  update(true);
}

// ----- sequences ----------------------------------------------------------------------------------------------
const fmt = (v, d = 3) => (v === null || v === undefined ? "–" : Number(v).toFixed(d));
function showToken(text) { return text.replace(/\n/g, "↵\n").replace(/\t/g, "→"); }
const ENDS = {end_token: "ended: end token", length_limit: "cut at the length limit", stop: "stopped short"};
function renderSequence(seq, index) {
  const div = document.createElement("div");
  div.className = seq.sk === "recheck" || !seq.sk ? "seq" : "seq skipped"; div.dataset.k = index;
  const head = document.createElement("div");
  head.className = "seq-head";
  const source = SOURCES[seq.src] || "?";
  head.innerHTML = `<b>${escapeHtml(DATA.runs[seq.r].label)}</b> · step ${seq.s} · ` +
    `<span class="badge source" style="background:${SOURCE_COLORS[source] || "#999"}">${source}</span> · ` +
    (seq.te === null ? "" : `teacher <span class="badge teacher" style="background:${teacherColor(seq.te, 0)}">` +
      `${escapeHtml(seq.te)}</span> · `) +
    (!seq.sk ? "" : seq.sk === "recheck"
      ? `<span class="badge recheck" title="correct, scored anyway (recheck_fraction)">recheck</span> · `
      : `<span class="badge skipped" title="not scored by the teacher; weight 0">skipped: ${escapeHtml(seq.sk)}</span> · `) +
    (seq.ca === null || seq.ca === undefined ? "" : `<span class="badge cached" title="trained from the teacher cache: ` +
      `rollouts and teacher signal sampled ${seq.ca} step(s) earlier">from cache, age ${seq.ca}</span> · `) +
    (!seq.ed ? "" : `<span class="badge end-${seq.ed}" title="how the rollout ended">${ENDS[seq.ed]}</span> · `) +
    (seq.rp ? `<span class="badge repeats" title="repeats a line or a 10-word run (answers.repeats_itself)">repeats</span> · ` : "") +
    (seq.sk && seq.sk !== "recheck" ? `${seq.lp.length} tokens, not supervised` : `${seq.lp.length} supervised tokens`) +
    ` · reward ${fmt(seq.rw, 2)} · off-policy gap ${fmt(seq.gap)} · ` +
    `teacher KL ${fmt(seq.kl)}`;
  let prompt = promptBlock(seq.p, null);
  if (seq.tp !== null && seq.tp !== undefined) {  // the teacher read a prompt of its own: the two side by side
    const prompts = document.createElement("div");
    prompts.className = "prompts";
    const extra = seq.tc === null ? "" : ` (${seq.tc >= 0 ? "+" : ""}${seq.tc} tokens)`;
    prompts.append(promptBlock(seq.p, "student's prompt"), promptBlock(seq.tp, "teacher's prompt" + extra));
    prompts.querySelectorAll(".prompt")[1].classList.add("teacher-prompt");
    prompt = prompts;
  }
  const body = document.createElement("div");
  body.className = "text completion";
  const parts = [];
  const chunked = new Set(seq.ne || []);  // a teacher of another tokenizer: tokens whose teacher value is not exact
  for (let i = 0; i < seq.lp.length; i++) {
    const style = `background:${tokenColor(seq, i)}`, kind = chunked.has(i) ? "tok chunked" : "tok";
    parts.push(seq.t ? `<span class="${kind}" data-i="${i}" style="${style}">${escapeHtml(showToken(seq.t[i]))}</span>`
      : `<span class="${kind} cell" data-i="${i}" style="${style}"></span>`);
  }
  body.innerHTML = parts.join("");
  if (!seq.t) {  // an older ledger without per-token text: the text, then one cell per supervised token
    const text = document.createElement("div");
    text.textContent = seq.c; body.prepend(text);
  }
  div.append(head, prompt, body);
  return div;
}
function promptBlock(text, label) {  // the prompt's last 300 characters; a click shows the rest
  const block = document.createElement("div");
  block.className = "text prompt";
  const tail = 300;
  const labelled = (...parts) => {
    block.replaceChildren();
    if (label) {
      const caption = document.createElement("span");
      caption.className = "prompt-label"; caption.textContent = label; block.append(caption);
    }
    block.append(...parts);
  };
  if (text.length > tail) {
    const more = document.createElement("span");
    more.className = "more"; more.textContent = "… ";
    more.title = "show the whole prompt";
    more.addEventListener("click", () => labelled(text));
    labelled(more, text.slice(-tail));
  } else labelled(text);
  return block;
}
function escapeHtml(text) {
  return String(text).replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));
}
let shown = [];
function renderSequences() {
  const visible = visibleSequences();
  const pages = Math.max(1, Math.ceil(visible.length / PAGE_SIZE));
  state.page = Math.min(Math.max(0, state.page), pages - 1);
  shown = visible.slice(state.page * PAGE_SIZE, (state.page + 1) * PAGE_SIZE);
  const list = $("sequences");
  list.replaceChildren(...shown.map(renderSequence));
  list.dataset.visible = visible.length;
  $("page-info").textContent = visible.length
    ? `sequences ${state.page * PAGE_SIZE + 1}–${state.page * PAGE_SIZE + shown.length} of ${visible.length} (page ${state.page + 1} of ${pages})`
    : "no sequence matches the filters";
  $("prev").disabled = state.page === 0; $("next").disabled = state.page >= pages - 1;
}
function renderLegend() {
  const legend = $("legend");
  if (state.color === "source") {
    legend.innerHTML = "Token colour: state source " + SOURCES.map((s) =>
      `<span class="swatch" style="background:${SOURCE_TINTS[s]}"></span> ${s}`).join(" ");
    return;
  }
  if (state.color === "teacher_id") {
    legend.innerHTML = "Token colour: the row's teacher " + TEACHERS.map((t) =>
      `<span class="swatch" style="background:${teacherColor(t, 0.55)}"></span> ${escapeHtml(t)}`).join(" ");
    return;
  }
  const q = QUANTITIES[state.color], domain = DOMAINS[state.color];
  if (domain === null) { legend.textContent = `No ${q.label} in these ledgers (grey tokens).`; return; }
  let low, high, stops;
  if (q.kind === "logp") { low = -domain; high = 0; stops = [mix(WHITE, RED, 1), mix(WHITE, RED, 0)]; }
  else if (q.kind === "entropy") { low = 0; high = domain; stops = [mix(WHITE, PURPLE, 0), mix(WHITE, PURPLE, 1)]; }
  else { low = -domain; high = domain; stops = [mix(WHITE, BLUE, 1), "rgb(255,255,255)", mix(WHITE, RED, 1)]; }
  legend.innerHTML = `Token colour: ${escapeHtml(q.label)} <span>${fmt(low, 2)}</span>` +
    `<span class="ramp" style="background:linear-gradient(to right,${stops.join(",")})"></span>` +
    `<span>${fmt(high, 2)}</span> <span class="swatch" style="background:#e6e6e6"></span> no value`;
}

// tooltip: one element, filled on hover
function setupTooltip() {
  const tip = $("tooltip");
  $("sequences").addEventListener("mousemove", (event) => {
    const tok = event.target.closest(".tok");
    if (!tok) { tip.hidden = true; return; }
    const seq = shown[Number(tok.closest(".seq").dataset.k)], i = Number(tok.dataset.i);
    const rows = [["prefix length", prefixOf(seq, i)], ["learner log p", fmt(logpOf(seq, i))],
      ["teacher log p", fmt(teacherOf(seq, i))], ["gap log p_S - log p_T", fmt(gapOf(seq, i))],
      ["learner entropy", fmt(entropyOf(seq, i), 2)], ["weight", fmt(weightOf(seq, i))],
      ["source", SOURCES[seq.src]], ...(seq.te === null ? [] : [["teacher", escapeHtml(seq.te)]]),
      ...(seq.ne && seq.ne.includes(i) ? [["teacher value", "its chunk's, shared out (another tokenizer)"]] : [])];
    const text = seq.t ? `<code>${escapeHtml(JSON.stringify(seq.t[i]))}</code>` : `token ${i}`;
    tip.innerHTML = text + "<table>" + rows.map(([k, v]) => `<tr><td>${k}</td><td>${v}</td></tr>`).join("") + "</table>";
    tip.hidden = false;
    tip.style.left = Math.min(event.clientX + 12, window.innerWidth - 330) + "px";
    tip.style.top = (event.clientY + 14) + "px";
  });
  $("sequences").addEventListener("mouseleave", () => { tip.hidden = true; });
}

// ----- charts: SVG, drawn by hand ------------------------------------------------------------------------------
function el(name, attrs, parent) {
  const node = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (parent) parent.append(node);
  return node;
}
function text(parent, x, y, content, attrs = {}) { el("text", {x, y, ...attrs}, parent).textContent = content; }
const W = 440, H = 150, M = {left: 48, right: 10, top: 18, bottom: 22};
function stepExtent() {
  let lo = Infinity, hi = -Infinity;
  for (const run of DATA.runs) for (const s of [...(run.steps.step || []), ...(run.drift.step || [])]) { lo = Math.min(lo, s); hi = Math.max(hi, s); }
  for (const seq of DATA.sequences) { lo = Math.min(lo, seq.s); hi = Math.max(hi, seq.s); }
  return lo === Infinity ? [0, 1] : [lo, Math.max(hi, lo + 1)];
}
const EXTENT = stepExtent();
const xScale = (step) => M.left + (step - EXTENT[0]) / (EXTENT[1] - EXTENT[0]) * (W - M.left - M.right);
const stepAt = (x) => EXTENT[0] + (x - M.left) / (W - M.left - M.right) * (EXTENT[1] - EXTENT[0]);
function brushable(svg) {  // drag across the plot to set the step filter; double-click clears it
  let start = null;
  const box = el("rect", {class: "brush", y: M.top, height: H - M.top - M.bottom, fill: "rgba(0,90,200,.15)", width: 0}, svg);
  const xOf = (event) => event.clientX - svg.getBoundingClientRect().left;
  svg.addEventListener("mousedown", (event) => { start = xOf(event); box.setAttribute("x", start); box.setAttribute("width", 0); });
  svg.addEventListener("mousemove", (event) => {
    if (start === null) return;
    const x = xOf(event);
    box.setAttribute("x", Math.min(start, x)); box.setAttribute("width", Math.abs(x - start));
  });
  svg.addEventListener("mouseup", (event) => {
    if (start === null) return;
    const a = stepAt(Math.min(start, xOf(event))), b = stepAt(Math.max(start, xOf(event)));
    start = null; box.setAttribute("width", 0);
    if (b - a > 0) setSteps(Math.ceil(a), Math.floor(b));
  });
  svg.addEventListener("dblclick", () => setSteps(null, null));
}
function selection(svg) {  // the step filter shown on every chart
  const g = el("g", {class: "selection"}, svg);
  return () => {
    g.replaceChildren();
    if (state.stepMin === null && state.stepMax === null) return;
    const a = xScale(state.stepMin ?? EXTENT[0]), b = xScale(state.stepMax ?? EXTENT[1]);
    el("rect", {x: M.left, y: M.top, width: Math.max(0, a - M.left), height: H - M.top - M.bottom, fill: "rgba(255,255,255,.7)"}, g);
    el("rect", {x: b, y: M.top, width: Math.max(0, W - M.right - b), height: H - M.top - M.bottom, fill: "rgba(255,255,255,.7)"}, g);
    el("line", {x1: a, x2: a, y1: M.top, y2: H - M.bottom, stroke: "#05c"}, g);
    el("line", {x1: b, x2: b, y1: M.top, y2: H - M.bottom, stroke: "#05c"}, g);
  };
}
const redraws = [];
function xAxis(svg) {
  el("line", {x1: M.left, x2: W - M.right, y1: H - M.bottom, y2: H - M.bottom, stroke: "#999"}, svg);
  for (const t of [EXTENT[0], Math.round((EXTENT[0] + EXTENT[1]) / 2), EXTENT[1]]) text(svg, xScale(t), H - 6, t, {"text-anchor": "middle"});
}
function lineChart(title, series) {  // series: [{label, color, x: [], y: []}]
  const values = series.flatMap((s) => s.y.filter((v) => v !== null));
  if (!values.length) return null;
  let lo = Math.min(...values), hi = Math.max(...values);
  if (hi - lo < 1e-12) { lo -= 0.5; hi += 0.5; }
  const y = (v) => H - M.bottom - (v - lo) / (hi - lo) * (H - M.top - M.bottom);
  const svg = el("svg", {class: "chart line-chart", width: W, height: H, viewBox: `0 0 ${W} ${H}`});
  text(svg, M.left, 12, title, {class: "title"});
  text(svg, M.left - 4, y(hi) + 4, fmt(hi, 3), {"text-anchor": "end"});
  text(svg, M.left - 4, y(lo) + 4, fmt(lo, 3), {"text-anchor": "end"});
  if (lo < 0 && hi > 0) el("line", {x1: M.left, x2: W - M.right, y1: y(0), y2: y(0), stroke: "#bbb", "stroke-dasharray": "3 3"}, svg);
  xAxis(svg);
  for (const s of series) {
    let d = "";
    s.x.forEach((step, i) => { if (s.y[i] !== null) d += (d ? "L" : "M") + xScale(step).toFixed(1) + "," + y(s.y[i]).toFixed(1); });
    el("path", {d, fill: "none", stroke: s.color, "stroke-width": 1.5}, svg).append(Object.assign(document.createElementNS(SVG_NS, "title"), {textContent: s.label}));
  }
  redraws.push(selection(svg));
  brushable(svg);
  return svg;
}
const MAX_COLUMNS = 240;  // longer runs are binned into this many step columns
function heatmap(run, index) {
  const steps = run.steps.step, hists = run.hist;
  const bins = Math.max(...hists.map((h) => h.length));
  const columns = Math.min(steps.length, MAX_COLUMNS);
  const grid = Array.from({length: columns}, () => new Float64Array(bins));
  const colStep = Array.from({length: columns}, () => [Infinity, -Infinity]);
  hists.forEach((h, i) => {
    const c = Math.min(columns - 1, Math.floor(i * columns / steps.length));
    h.forEach((v, k) => { grid[c][k] += v; });
    colStep[c][0] = Math.min(colStep[c][0], steps[i]); colStep[c][1] = Math.max(colStep[c][1], steps[i]);
  });
  const svg = el("svg", {class: "chart heatmap", width: W, height: H, viewBox: `0 0 ${W} ${H}`});
  text(svg, M.left, 12, run.label + ": prefix length of supervised tokens (darker: larger share)", {class: "title"});
  const rowH = (H - M.top - M.bottom) / bins;
  for (let k = 0; k < bins; k++) {
    if (k % Math.ceil(bins / 6) === 0) {
      const low = 2 ** k - 1, high = 2 ** (k + 1) - 2;
      text(svg, M.left - 4, H - M.bottom - k * rowH - rowH / 2 + 3, low === high ? low : `${low}-${high}`, {"text-anchor": "end"});
    }
  }
  grid.forEach((counts, c) => {
    const total = counts.reduce((a, b) => a + b, 0);
    if (!total) return;
    const [a, b] = colStep[c];
    const x0 = Math.max(M.left, xScale(a - 0.5)), x1 = Math.min(W - M.right, xScale(b + 0.5));
    counts.forEach((v, k) => {
      if (!v) return;
      const rect = el("rect", {class: "cell", x: x0.toFixed(1), y: (H - M.bottom - (k + 1) * rowH).toFixed(1),
        width: Math.max(1, x1 - x0).toFixed(1), height: rowH.toFixed(1), fill: mix(WHITE, [8, 48, 107], Math.sqrt(v / total))}, svg);
      rect.append(Object.assign(document.createElementNS(SVG_NS, "title"),
        {textContent: `steps ${a}${b > a ? "-" + b : ""}, prefix bin ${k}: ${(100 * v / total).toFixed(1)}% of ${total} tokens`}));
    });
  });
  xAxis(svg);
  redraws.push(selection(svg));
  brushable(svg);
  return svg;
}
function renderCharts() {
  const heatmaps = $("heatmaps"), charts = $("charts");
  DATA.runs.forEach((run, i) => {
    for (const note of run.notes) {
      const p = document.createElement("p"); p.className = "note"; p.textContent = run.label + ": " + note; heatmaps.append(p);
    }
    if (run.hist && run.steps.step) heatmaps.append(heatmap(run, i));
  });
  if (!heatmaps.querySelector("svg")) heatmaps.append("No run has prefix_len_hist in statelens/steps.jsonl.");
  const color = (i) => RUN_COLORS[i % RUN_COLORS.length];
  for (const [key, title, group] of [...DATA.step_metrics.map(([k, t]) => [k, t, "steps"]), ...DATA.drift_metrics.map(([k, t]) => [k, t, "drift"])]) {
    const series = DATA.runs.map((run, i) => run[group][key] ? {label: run.label, color: color(i), x: run[group].step, y: run[group][key]} : null).filter(Boolean);
    const svg = series.length ? lineChart(title, series) : null;
    if (svg) charts.append(svg);
  }
  if (!charts.querySelector("svg")) charts.append("No per-step metrics (statelens/steps.jsonl, drift.jsonl) in these runs.");
}

function update(resetPage) {
  if (resetPage) state.page = 0;
  renderLegend();
  renderSequences();
  redraws.forEach((redraw) => redraw());
  writeHash();
}

const started = performance.now();
readHash();
const ledgerTotal = DATA.runs.reduce((a, r) => a + r.ledger_sequences, 0);
$("summary").textContent = `${DATA.runs.length} run(s) · ${DATA.sequences.length} sequences shown of ${ledgerTotal} in the ledgers` +
  (DATA.sequences.length < ledgerTotal ? " (spread evenly over each ledger)" : "") + " · hover a token for its values";
setupControls();
setupTooltip();
renderCharts();
update(false);
window.addEventListener("hashchange", () => { readHash(); syncControls(); update(false); });
document.body.dataset.renderMs = (performance.now() - started).toFixed(0);
document.body.dataset.ready = "1";
