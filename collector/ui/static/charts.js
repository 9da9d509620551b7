// vigil web UI: small canvas charts drawn by hand (no library): line charts over steps with a
// hover read-out, and a per-rank timeline of a step window (steps, phases, collectives).
"use strict";
(function () {
  const V = window.vigil;
  const COLOURS = ["#4e9af1", "#f5a623", "#7ed321", "#d0021b", "#bd10e0", "#50e3c2"];

  function setup(canvas, height) {
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.parentElement.clientWidth || 600;
    canvas.width = Math.floor(width * ratio);
    canvas.height = Math.floor(height * ratio);
    canvas.style.width = width + "px";
    canvas.style.height = height + "px";
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    return { ctx, width, height };
  }

  // series: [{label, values, colour}], x: steps; fmt: value -> text.
  V.lineChart = function (canvas, { title, x, series, fmt, height }) {
    const { ctx, width, height: h } = setup(canvas, height || 150);
    const pad = { l: 64, r: 10, t: 18, b: 20 };
    const all = series.flatMap((s) => s.values).filter((v) => typeof v === "number" && isFinite(v));
    ctx.clearRect(0, 0, width, h);
    ctx.fillStyle = "#c9d1d9";
    ctx.font = "12px sans-serif";
    ctx.fillText(title, pad.l, 12);
    if (!x.length || !all.length) {
      ctx.fillStyle = "#8b949e";
      ctx.fillText("no data yet", pad.l, h / 2);
      canvas.onmousemove = null;
      return;
    }
    let lo = Math.min(0, ...all), hi = Math.max(...all);
    if (hi <= lo) hi = lo + 1;
    const x0 = x[0], x1 = x[x.length - 1] === x0 ? x0 + 1 : x[x.length - 1];
    const px = (s) => pad.l + ((s - x0) / (x1 - x0)) * (width - pad.l - pad.r);
    const py = (v) => h - pad.b - ((v - lo) / (hi - lo)) * (h - pad.t - pad.b);
    ctx.strokeStyle = "#30363d";
    ctx.fillStyle = "#8b949e";
    for (let i = 0; i <= 2; i++) {
      const v = lo + ((hi - lo) * i) / 2;
      ctx.beginPath(); ctx.moveTo(pad.l, py(v)); ctx.lineTo(width - pad.r, py(v)); ctx.stroke();
      ctx.fillText(fmt(v), 2, py(v) + 4);
    }
    ctx.fillText("step " + x0, pad.l, h - 4);
    ctx.fillText("step " + x[x.length - 1], width - pad.r - 70, h - 4);
    series.forEach((s, k) => {
      ctx.strokeStyle = s.colour || COLOURS[k % COLOURS.length];
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      let pen = false;
      s.values.forEach((v, i) => {
        if (typeof v !== "number" || !isFinite(v)) { pen = false; return; }
        if (pen) ctx.lineTo(px(x[i]), py(v)); else ctx.moveTo(px(x[i]), py(v));
        pen = true;
      });
      ctx.stroke();
      ctx.fillStyle = ctx.strokeStyle;
      ctx.fillText(s.label, width - pad.r - 160 + k * 70, 12);
    });
    canvas.onmousemove = (ev) => {
      const r = canvas.getBoundingClientRect();
      const step = x0 + ((ev.clientX - r.left - pad.l) / (width - pad.l - pad.r)) * (x1 - x0);
      let best = 0;
      x.forEach((s, i) => { if (Math.abs(s - step) < Math.abs(x[best] - step)) best = i; });
      V.tooltip(ev.clientX, ev.clientY, ["step " + x[best], ...series.map((s) => s.label + ": " + fmt(s.values[best]))]);
    };
    canvas.onmouseleave = () => V.tooltip();
  };

  const CAT_COLOURS = { step: "#3b4a5c", phase: "#4e9af1", collective: "#f5a623" };
  const PHASE_COLOURS = { data: "#8e7cc3", forward: "#4e9af1", backward: "#2f6fbf", optimizer: "#50e3c2", "exposed comm wait": "#d0021b" };

  // trace: Chrome trace JSON; rows are (pid, tid) pairs in rank order.
  V.timeline = function (canvas, trace, labels) {
    const events = trace.traceEvents.filter((e) => e.ph === "X");
    const keys = [...new Set(events.map((e) => e.pid + ":" + e.tid))].sort((a, b) => {
      const [pa, ta] = a.split(":").map(Number), [pb, tb] = b.split(":").map(Number);
      return pa - pb || ta - tb;
    });
    const rowH = 16;
    const { ctx, width, height } = setup(canvas, Math.max(40, keys.length * rowH + 24));
    const pad = { l: 120, r: 10 };
    ctx.clearRect(0, 0, width, height);
    if (!events.length) {
      ctx.fillStyle = "#8b949e"; ctx.font = "12px sans-serif";
      ctx.fillText("no step records in this window", 10, 20);
      return;
    }
    const t0 = Math.min(...events.map((e) => e.ts));
    const t1 = Math.max(...events.map((e) => e.ts + e.dur));
    const px = (t) => pad.l + ((t - t0) / Math.max(1, t1 - t0)) * (width - pad.l - pad.r);
    const tidName = { 1: "steps", 2: "phases", 3: "collectives" };
    ctx.font = "11px sans-serif";
    keys.forEach((k, i) => {
      const [pid, tid] = k.split(":").map(Number);
      ctx.fillStyle = "#8b949e";
      ctx.fillText((labels && labels[pid] ? labels[pid] : "rank " + pid) + " " + (tidName[tid] || tid), 2, i * rowH + 12);
    });
    const rowOf = new Map(keys.map((k, i) => [k, i]));
    for (const e of events) {
      const i = rowOf.get(e.pid + ":" + e.tid);
      ctx.fillStyle = PHASE_COLOURS[e.name] || CAT_COLOURS[e.cat] || "#777";
      ctx.fillRect(px(e.ts), i * rowH + 2, Math.max(1, px(e.ts + e.dur) - px(e.ts)), rowH - 4);
    }
    ctx.fillStyle = "#8b949e";
    ctx.fillText(V.fmtSeconds((t1 - t0) / 1e6) + " shown", pad.l, height - 4);
    canvas.onmousemove = (ev) => {
      const r = canvas.getBoundingClientRect();
      const i = Math.floor((ev.clientY - r.top) / rowH);
      const t = t0 + ((ev.clientX - r.left - pad.l) / (width - pad.l - pad.r)) * (t1 - t0);
      const hit = events.find((e) => rowOf.get(e.pid + ":" + e.tid) === i && e.ts <= t && t <= e.ts + e.dur);
      V.tooltip(ev.clientX, ev.clientY, hit ? ["rank " + hit.pid + ": " + hit.name, V.fmtSeconds(hit.dur / 1e6)] : null);
    };
    canvas.onmouseleave = () => V.tooltip();
  };
})();
