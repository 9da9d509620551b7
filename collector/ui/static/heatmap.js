// vigil web UI: the rank x step heat map on a canvas. The server sends at most ~500 x 800 cells,
// each the worst value of its block (so a slow cell survives downsampling), plus each column's
// median over all ranks; colour is the cell's ratio to its column's median. Wheel zooms, drag
// pans, and both fetch the window's detail; a click resolves the cell down to one rank and step.
"use strict";
(function () {
  const V = window.vigil;
  const PAD = { l: 96, r: 8, t: 6, b: 22 };
  const MAX_PLOT_ROWS = 520; // the plot's tallest height in CSS pixels

  function decode(buffer) {
    const length = new DataView(buffer).getUint32(0, true);
    const header = JSON.parse(new TextDecoder().decode(new Uint8Array(buffer, 4, length)));
    const cells = new Float32Array(buffer, 4 + length, header.num_cols * header.num_rows);
    return { header, cells };
  }

  // ratio 1 (the step's median) is slate; slower runs yellow to red; faster runs blue.
  function colour(ratio) {
    if (!isFinite(ratio)) return [22, 27, 34];
    if (ratio < 1) {
      const f = Math.min(1, (1 - ratio) * 2);
      return [52 - 20 * f, 66 + 30 * f, 84 + 100 * f];
    }
    const f = Math.min(1, (ratio - 1) / 1.0); // 2x the median and above is full red
    if (f < 0.25) { const g = f / 0.25; return [52 + 180 * g, 66 + 130 * g, 84 - 40 * g]; }
    const g = (f - 0.25) / 0.75;
    return [232 + 23 * g, 196 - 170 * g, 44 - 20 * g];
  }

  class Heatmap {
    constructor(canvas, { job, metric, group, onCell, onView }) {
      this.canvas = canvas;
      this.job = job;
      this.metric = metric;
      this.group = group;
      this.onCell = onCell;
      this.onView = onView || (() => {});
      this.window = null; // null: the last 1,000 steps, all rows, following new steps
      this.data = null;
      this.selection = null; // {ranks: Set, step_start, step_end}
      this.marker = null; // {rank, step}
      this.paints = 0;
      this.firstPaintMs = null;
      this.seq = 0;
      this.drag = null;
      this.pending = null;
      this.bind();
    }

    // At most one cell per CSS pixel of the plot (and 500 columns: ~1 MB of float32 cells for
    // a 10,000-rank job), so nothing is fetched that the canvas cannot show.
    budget() {
      const width = this.canvas.parentElement.clientWidth || 800;
      return { max_cols: Math.max(1, Math.min(500, width - PAD.l - PAD.r)), max_rows: MAX_PLOT_ROWS };
    }

    params(extra) {
      const q = new URLSearchParams(Object.assign({ metric: this.metric, group: this.group }, this.budget()));
      const w = Object.assign({}, this.window || {}, extra || {});
      for (const [k, v] of Object.entries(w)) if (v !== null && v !== undefined) q.set(k, v);
      return V.apiJob(this.job) + "/heatmap?" + q.toString();
    }

    async load() {
      const seq = ++this.seq;
      const started = performance.now();
      const buffer = await (await V.fetch(this.params())).arrayBuffer();
      if (seq !== this.seq) return; // a newer view was asked for meanwhile
      this.data = decode(buffer);
      this.fetchMs = performance.now() - started;
      this.draw();
      this.onView(this);
    }

    // Values the page holds, for people hovering and for tests.
    colOf(step) {
      const h = this.data.header;
      for (let c = h.steps.length - 1; c >= 0; c--) if (h.steps[c] <= step) return step < h.steps[c] + h.step_stride ? c : -1;
      return -1;
    }
    rowOf(rank) {
      const h = this.data.header;
      if (!h.ranks) return -1;
      const i = h.ranks.indexOf(rank);
      return i < 0 ? -1 : Math.floor(i / h.rank_stride);
    }
    valueAt(rank, step) {
      const c = this.colOf(step), r = this.rowOf(rank);
      if (c < 0 || r < 0) return null;
      const v = this.data.cells[c * this.data.header.num_rows + r];
      return isFinite(v) ? v : null;
    }
    ratioAt(rank, step) {
      const v = this.valueAt(rank, step);
      const m = this.data.header.medians[this.colOf(step)];
      if (v === null || !m) return null;
      return this.data.header.worst === "min" ? m / v : v / m;
    }
    // The canvas pixel (CSS px, relative to the canvas) at the middle of a cell.
    pixelOf(rank, step) {
      const c = this.colOf(step), r = this.rowOf(rank);
      const g = this.geometry();
      return { x: PAD.l + (c + 0.5) * g.cw, y: PAD.t + (r + 0.5) * g.rh };
    }

    geometry() {
      const h = this.data.header;
      const width = this.cssWidth, height = this.cssHeight;
      return { cw: (width - PAD.l - PAD.r) / Math.max(1, h.num_cols), rh: (height - PAD.t - PAD.b) / Math.max(1, h.num_rows), width, height };
    }

    draw() {
      const ratio = window.devicePixelRatio || 1;
      const width = this.canvas.parentElement.clientWidth || 800;
      const rows = this.data ? this.data.header.num_rows : 10;
      const height = Math.max(240, Math.min(MAX_PLOT_ROWS, 16 * rows) + PAD.t + PAD.b);
      this.cssWidth = width;
      this.cssHeight = height;
      this.canvas.width = Math.floor(width * ratio);
      this.canvas.height = Math.floor(height * ratio);
      this.canvas.style.width = width + "px";
      this.canvas.style.height = height + "px";
      const ctx = this.canvas.getContext("2d");
      ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
      ctx.fillStyle = "#0d1117";
      ctx.fillRect(0, 0, width, height);
      const { header: h, cells } = this.data;
      ctx.font = "11px sans-serif";
      if (!h.num_cols || !h.num_rows) {
        ctx.fillStyle = "#8b949e";
        ctx.fillText("no step records in this window", PAD.l, 30);
        this.markPainted();
        return;
      }
      const image = new ImageData(h.num_cols, h.num_rows);
      const low = h.worst === "min";
      for (let c = 0; c < h.num_cols; c++) {
        const m = h.medians[c];
        for (let r = 0; r < h.num_rows; r++) {
          const v = cells[c * h.num_rows + r];
          const q = m ? (low ? m / v : v / m) : NaN;
          const [R, G, B] = colour(q);
          const o = (r * h.num_cols + c) * 4;
          image.data[o] = R; image.data[o + 1] = G; image.data[o + 2] = B; image.data[o + 3] = 255;
        }
      }
      const off = document.createElement("canvas");
      off.width = h.num_cols; off.height = h.num_rows;
      off.getContext("2d").putImageData(image, 0, 0);
      ctx.imageSmoothingEnabled = false;
      const g = this.geometry();
      ctx.drawImage(off, PAD.l, PAD.t, h.num_cols * g.cw, h.num_rows * g.rh);
      this.drawAxes(ctx, g);
      this.drawSelection(ctx, g);
      this.markPainted();
    }

    markPainted() {
      this.paints += 1;
      if (this.firstPaintMs === null) this.firstPaintMs = performance.now();
      this.canvas.dataset.paints = String(this.paints);
    }

    drawAxes(ctx, g) {
      const h = this.data.header;
      ctx.fillStyle = "#8b949e";
      ctx.strokeStyle = "#0d1117";
      const groups = h.groups || [];
      if (groups.length) {
        for (const grp of groups) {
          const y0 = PAD.t + (Math.max(grp.row_start, h.row_start) - h.row_start) / h.rank_stride * g.rh;
          ctx.fillText(grp.label.slice(0, 14), 2, y0 + 11);
          ctx.strokeStyle = "#e6edf3";
          ctx.beginPath(); ctx.moveTo(PAD.l - 4, y0); ctx.lineTo(g.width - PAD.r, y0); ctx.stroke();
        }
      } else {
        const every = Math.max(1, Math.ceil(14 / g.rh));
        for (let r = 0; r < h.num_rows; r += every) {
          const label = h.ranks ? "rank " + h.ranks[r * h.rank_stride] : "row " + (h.row_start + r * h.rank_stride);
          ctx.fillText(label, 2, PAD.t + (r + 0.5) * g.rh + 4);
        }
      }
      const ticks = Math.min(8, h.num_cols);
      for (let i = 0; i < ticks; i++) {
        const c = Math.floor((i * h.num_cols) / ticks);
        ctx.fillText(String(h.steps[c]), PAD.l + c * g.cw, g.height - 6);
      }
    }

    drawSelection(ctx, g) {
      const h = this.data.header;
      ctx.lineWidth = 2;
      if (this.selection) {
        ctx.strokeStyle = "#ffffff";
        const c0 = h.steps.findIndex((s) => s + h.step_stride > this.selection.step_start);
        let c1 = h.steps.findIndex((s) => s > this.selection.step_end);
        if (c1 < 0) c1 = h.num_cols;
        for (const rank of this.selection.ranks) {
          const r = this.rowOf(rank);
          if (r >= 0 && c0 >= 0) ctx.strokeRect(PAD.l + c0 * g.cw, PAD.t + r * g.rh, Math.max(2, (c1 - c0) * g.cw), Math.max(2, g.rh));
        }
      }
      if (this.marker) {
        const r = this.rowOf(this.marker.rank), c = this.colOf(this.marker.step);
        if (r >= 0 && c >= 0) {
          ctx.strokeStyle = "#58a6ff";
          ctx.strokeRect(PAD.l + c * g.cw - 1, PAD.t + r * g.rh - 1, Math.max(3, g.cw + 2), Math.max(3, g.rh + 2));
        }
      }
    }

    cellAt(ev) {
      if (!this.data) return null;
      const rect = this.canvas.getBoundingClientRect();
      const g = this.geometry();
      const c = Math.floor((ev.clientX - rect.left - PAD.l) / g.cw);
      const r = Math.floor((ev.clientY - rect.top - PAD.t) / g.rh);
      const h = this.data.header;
      if (c < 0 || r < 0 || c >= h.num_cols || r >= h.num_rows) return null;
      return { c, r };
    }

    describe({ c, r }) {
      const h = this.data.header;
      const v = this.data.cells[c * h.num_rows + r];
      const first = h.row_start + r * h.rank_stride;
      const ranks = h.ranks ? h.ranks.slice(r * h.rank_stride, (r + 1) * h.rank_stride) : [];
      const who = ranks.length === 1 ? "rank " + ranks[0] : ranks.length ? "ranks " + ranks[0] + "…" + ranks[ranks.length - 1] + " (" + ranks.length + ")" : "rows from " + first;
      const steps = h.step_stride === 1 ? "step " + h.steps[c] : "steps " + h.steps[c] + "–" + (h.steps[c] + h.step_stride - 1);
      const m = h.medians[c];
      const q = m ? (h.worst === "min" ? m / v : v / m) : NaN;
      const lines = [who + " · " + steps, h.metric + ": " + V.fmtValue(isFinite(v) ? v : null, h.unit) + (h.rank_stride > 1 || h.step_stride > 1 ? " (worst of block)" : "")];
      if (isFinite(q)) lines.push("×" + q.toFixed(2) + " of the step's median (" + V.fmtValue(m, h.unit) + ")");
      return lines;
    }

    bind() {
      const cv = this.canvas;
      cv.addEventListener("mousemove", (ev) => {
        if (this.drag) { this.dragTo(ev); return; }
        const cell = this.cellAt(ev);
        V.tooltip(ev.clientX, ev.clientY, cell ? this.describe(cell) : null);
      });
      cv.addEventListener("mouseleave", () => V.tooltip());
      cv.addEventListener("mousedown", (ev) => { this.drag = { x: ev.clientX, y: ev.clientY, moved: false, window: this.current() }; });
      window.addEventListener("mouseup", (ev) => {
        const drag = this.drag;
        this.drag = null;
        if (!drag) return;
        if (drag.moved) this.schedule();
        else if (ev.target === cv) this.click(ev);
      });
      cv.addEventListener("wheel", (ev) => { ev.preventDefault(); this.zoom(ev); }, { passive: false });
      cv.addEventListener("dblclick", () => this.reset());
    }

    // The window asked for last (a zoom may still be on its way), else the one shown.
    current() {
      const h = this.data.header;
      if (this.window) return Object.assign({ total_rows: h.total_rows }, this.window);
      return { step_start: h.step_start, step_end: h.step_end, row_start: h.row_start, row_end: h.row_end, total_rows: h.total_rows };
    }

    zoom(ev) {
      if (!this.data || !this.data.header.num_cols) return;
      const w = this.current();
      const rect = this.canvas.getBoundingClientRect();
      const g = this.geometry();
      const fx = Math.min(1, Math.max(0, (ev.clientX - rect.left - PAD.l) / (g.width - PAD.l - PAD.r)));
      const fy = Math.min(1, Math.max(0, (ev.clientY - rect.top - PAD.t) / (g.height - PAD.t - PAD.b)));
      const k = ev.deltaY < 0 ? 0.6 : 1 / 0.6;
      const span = (a, b, f, scale, lo, hi) => {
        const width = Math.max(1, Math.round((b - a + 1) * scale));
        let start = Math.round(a + (b - a + 1) * f - width * f);
        start = Math.max(lo, Math.min(start, hi - width + 1));
        return [start, Math.min(hi, start + width - 1)];
      };
      const lastStep = this.lastStep === undefined ? w.step_end : Math.max(this.lastStep, w.step_end);
      const [s0, s1] = span(w.step_start, w.step_end, fx, k, 0, lastStep);
      const [r0, r1] = span(w.row_start, w.row_end, fy, ev.shiftKey ? 1 : k, 0, w.total_rows - 1);
      this.setWindow({ step_start: s0, step_end: s1, row_start: r0, row_end: r1 });
    }

    dragTo(ev) {
      const d = this.drag;
      const dx = ev.clientX - d.x, dy = ev.clientY - d.y;
      if (Math.abs(dx) + Math.abs(dy) > 4) d.moved = true;
      if (!d.moved) return;
      const g = this.geometry();
      const w = d.window;
      const steps = w.step_end - w.step_start + 1, rows = w.row_end - w.row_start + 1;
      const ds = Math.round((-dx / (g.width - PAD.l - PAD.r)) * steps);
      const dr = Math.round((-dy / (g.height - PAD.t - PAD.b)) * rows);
      const s0 = Math.max(0, w.step_start + ds);
      const r0 = Math.max(0, Math.min(w.total_rows - rows, w.row_start + dr));
      this.window = { step_start: s0, step_end: s0 + steps - 1, row_start: r0, row_end: r0 + rows - 1 };
    }

    setWindow(w) { this.window = w; this.schedule(); }
    schedule() {
      clearTimeout(this.pending);
      this.pending = setTimeout(() => this.load().catch((e) => V.errorBox(this.canvas.parentElement.querySelector(".heat-error"), e)), 120);
    }
    reset() { this.window = null; this.schedule(); }
    following() { return this.window === null; }

    // A click resolves a block to its worst (rank, step): fetch the block at full resolution.
    async click(ev) {
      const cell = this.cellAt(ev);
      if (!cell) return;
      const h = this.data.header;
      const step0 = h.steps[cell.c], row0 = h.row_start + cell.r * h.rank_stride;
      let rank, step;
      if (h.step_stride === 1 && h.rank_stride === 1 && h.ranks) {
        rank = h.ranks[cell.r]; step = step0;
      } else {
        const q = new URLSearchParams({ metric: this.metric, group: this.group, step_start: step0, step_end: step0 + h.step_stride - 1, row_start: row0, row_end: row0 + h.rank_stride - 1, max_cols: 4000, max_rows: 4000 });
        const block = decode(await (await V.fetch(V.apiJob(this.job) + "/heatmap?" + q)).arrayBuffer());
        let best = -1, bestValue = h.worst === "min" ? Infinity : -Infinity;
        block.cells.forEach((v, i) => {
          if (isFinite(v) && (h.worst === "min" ? v < bestValue : v > bestValue)) { best = i; bestValue = v; }
        });
        if (best < 0 || !block.header.ranks) return;
        rank = block.header.ranks[best % block.header.num_rows];
        step = block.header.steps[Math.floor(best / block.header.num_rows)];
      }
      this.marker = { rank, step };
      this.draw();
      this.onCell(rank, step);
    }
  }
  V.Heatmap = Heatmap;
})();
