// vigil web UI: one job: its description and figures over steps, the rank x step heat map,
// a cell's drill-down (phases beside the median rank's, collectives, GPU samples, timeline,
// trace download), findings (a click selects their cells), recovery timeline, checkpoints and,
// for a hang, who is behind in which group and the grouped stacks.
"use strict";
(function () {
  const V = window.vigil;
  const el = V.el;
  const METRICS = [["step_time", "step time"], ["compute", "compute"], ["wait", "exposed wait"], ["collective", "collective time"], ["mfu", "MFU"], ["peak_memory", "peak memory"]];
  const GROUPS = [["rank", "rank"], ["node", "node"], ["dp", "dp"], ["tp", "tp"], ["pp", "pp"]];
  const PHASES = [["data_s", "data"], ["forward_s", "forward"], ["backward_s", "backward"], ["optimizer_s", "optimizer"], ["comm_wait_s", "exposed comm wait"]];

  function select(id, options, value, onChange) {
    const s = el("select", { id, onchange: () => onChange(s.value) }, ...options.map(([v, t]) => el("option", { value: v, text: t })));
    s.value = value;
    return s;
  }

  function section(title, id, ...children) {
    return el("section", { id, class: "card" }, el("h2", { text: title }), ...children);
  }

  function table(headers, rows, attrs) {
    return el("table", attrs || {}, el("thead", {}, el("tr", {}, ...headers.map((h) => el("th", { text: h })))),
      el("tbody", {}, ...rows.map((r) => el("tr", {}, ...r.map((c) => (c instanceof Node ? el("td", {}, c) : el("td", { text: c })))))));
  }

  V.jobPage = function (main, job, params) {
    V.clear(main);
    V.crumbs([job]);
    const state = { metric: params.get("metric") || "step_time", group: params.get("group") || "rank" };
    if (!METRICS.some(([m]) => m === state.metric)) state.metric = "step_time";
    const head = el("section", { id: "job-head", class: "card" });
    const charts = el("div", { class: "charts" }, ...["chart-step", "chart-mfu", "chart-tokens"].map((id) => el("div", { class: "chart" }, el("canvas", { id }))));
    const canvas = el("canvas", { id: "heatmap", class: "heatmap" });
    const heatInfo = el("span", { id: "heat-info", class: "muted" });
    const heatBox = el("div", { class: "heat-box" }, canvas, el("div", { class: "heat-error" }));
    const drill = el("div", { id: "drill" }, el("p", { class: "muted", text: "Click a cell of the heat map to see that rank at that step." }));
    const findings = el("div", { id: "findings" });
    const recovery = el("div", { id: "recovery" });
    const checkpoints = el("div", { id: "checkpoints" });
    const hang = el("div", { id: "hang" });
    const setUrl = (extra) => {
      const q = new URLSearchParams(location.search);
      for (const [k, v] of Object.entries(extra)) (v === null || v === undefined ? q.delete(k) : q.set(k, v));
      history.replaceState(null, "", V.pageJob(job, Object.fromEntries(q)));
    };
    const heat = new V.Heatmap(canvas, {
      job, metric: state.metric, group: state.group,
      onCell: (rank, step) => { setUrl({ rank, step }); openCell(rank, step); },
      onView: (h) => {
        const d = h.data.header;
        heatInfo.textContent = (d.num_cols ? "steps " + d.step_start + "–" + d.step_end + " · " + d.total_rows + " ranks" : "") +
          (d.step_stride > 1 || d.rank_stride > 1 ? " · each cell the worst of " + d.step_stride + " step(s) × " + d.rank_stride + " rank(s)" : "") +
          " · " + Math.round(h.fetchMs) + " ms";
      },
    });
    V.heat = heat;
    const controls = el("div", { class: "toolbar" },
      el("label", {}, "metric ", select("heat-metric", METRICS, state.metric, (v) => { heat.metric = v; setUrl({ metric: v }); heat.load().catch((e) => V.errorBox(heatBox.querySelector(".heat-error"), e)); })),
      el("label", {}, "rows by ", select("heat-group", GROUPS, state.group, (v) => { heat.group = v; heat.window = null; heat.load().catch((e) => V.errorBox(heatBox.querySelector(".heat-error"), e)); })),
      el("button", { type: "button", id: "heat-reset", onclick: () => heat.reset(), text: "full view" }),
      heatInfo);
    main.append(head, charts,
      section("Rank × step", "heat", controls, el("p", { class: "muted legend", text: "colour: ratio to the step's median (slate = median, yellow → red = up to 2× worse, blue = better); wheel zooms (shift: steps only), drag pans, double-click resets" }), heatBox),
      section("Drill-down", "drill-card", drill),
      section("Findings", "findings-card", findings),
      section("Recovery", "recovery-card", recovery),
      section("Checkpoints", "checkpoints-card", checkpoints),
      section("Hang: last sequence numbers", "hang-card", hang));

    function renderHead(o) {
      const j = o.job || {};
      const s = o.state;
      V.clear(head).append(
        el("h1", {}, j.name || job, " ", el("span", { class: "state " + s.state, text: s.state })),
        el("dl", { class: "facts" },
          ...[["job", job], ["world size", V.fmtNum(s.world_size, 0)], ["layout", V.fmtLayout(j.layout)], ["model", j.model ? Object.entries(j.model).map(([k, v]) => k + " " + V.fmtNum(v, 0)).join(", ") : "–"], ["device", j.device_kind || "–"], ["last step", s.last_step === null ? "–" : String(s.last_step)], ["ranks reporting", String(s.num_ranks_reporting)], ["open findings", String(s.open_findings)]]
            .flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: v, id: "fact-" + k.replace(/ /g, "-") })])));
      heat.lastStep = s.last_step || 0;
    }

    function renderFindings(list) {
      V.clear(findings);
      if (!list.length) { findings.append(el("p", { class: "muted", text: "No findings." })); return; }
      for (const f of list) {
        const ranks = (f.subjects && f.subjects.ranks) || [];
        const item = el("div", { class: "finding " + f.state, tabindex: "0", dataset: { finding: f.finding_id },
          onclick: () => {
            heat.selection = { ranks: new Set(ranks), step_start: f.step_start, step_end: f.step_end };
            if (heat.data) heat.draw();
            if (ranks.length && f.step_start >= 0) { setUrl({ rank: ranks[0], step: f.step_start }); openCell(ranks[0], f.step_start); }
          } },
          el("div", { class: "finding-head" }, el("span", { class: "kind", text: f.kind }), " ", el("span", { text: f.summary })),
          el("div", { class: "muted" }, "confidence " + V.fmtPct(f.confidence) + " · steps " + f.step_start + "–" + f.step_end + " · " + f.state + " · detected " + V.fmtTime(f.detected_s) +
            " · subjects " + Object.entries(f.subjects || {}).map(([k, v]) => k + " " + v.join(", ")).join("; ")),
          table(["metric", "observed", "baseline", "unit", "note"], (f.evidence || []).map((e) => [e.metric, V.fmtNum(e.observed, 4), V.fmtNum(e.baseline, 4), e.unit || "", e.note || ""]), { class: "evidence" }));
        findings.append(item);
      }
    }

    function renderRecovery(list) {
      V.clear(recovery);
      if (!list.length) { recovery.append(el("p", { class: "muted", text: "No recovery actions." })); return; }
      for (const r of list) {
        const chain = el("div", { class: "chain" }, el("span", { class: "chip detected", text: "detected " + r.kind + " " + V.fmtTime(r.detected_s) }));
        for (const a of r.actions) chain.append(" → ", el("span", { class: "chip action " + a.state, title: a.result || "", text: a.kind + " (" + a.state + ") " + V.fmtTime(a.start_s) }));
        chain.append(" → ", el("span", { class: "chip " + (r.resumed_s ? "resumed" : "pending"), text: r.resumed_s ? "resumed " + V.fmtTime(r.resumed_s) + (r.resume_step !== null ? " at step " + r.resume_step : "") : "not resumed yet" }));
        recovery.append(el("div", { class: "recovery" }, el("div", { text: r.summary }), chain,
          el("div", { class: "muted" }, "time to recover " + V.fmtSeconds(r.time_to_recover_s) + " · steps lost " + (r.steps_lost === null ? "–" : r.steps_lost))));
      }
    }

    function renderCheckpoints(list) {
      V.clear(checkpoints).append(list.length ? table(["step", "location", "size", "save", "training blocked", "verified"],
        list.map((c) => [String(c.step), c.location, V.fmtBytes(c.bytes), V.fmtSeconds(c.save_s), V.fmtSeconds(c.blocked_s), c.verified ? "yes" : "no"])) : el("p", { class: "muted", text: "No checkpoints." }));
    }

    async function renderHang(o) {
      const hangs = o.findings.filter((f) => f.kind === "hang");
      const card = document.getElementById("hang-card");
      card.hidden = !hangs.length;
      if (!hangs.length) return;
      const h = await V.json(V.apiJob(job) + "/hang");
      const maxOf = h.groups.map((_, g) => Math.max(...h.last_seq.map((row) => (row[g] === null ? -1 : row[g]))));
      const rows = h.ranks.map((rank, i) => [String(rank), ...h.groups.map((_, g) => {
        const v = h.last_seq[i][g];
        return el("span", { class: v !== null && v < maxOf[g] ? "behind" : "", text: v === null ? "–" : String(v) });
      })]);
      V.clear(hang).append(table(["rank", ...h.groups], rows, { class: "seq", id: "hang-matrix" }),
        el("h3", { text: "Stacks, grouped" }),
        ...(h.stacks.length ? h.stacks.map((s) => el("pre", { class: "stack", text: "ranks (" + s.ranks + "): " + s.note })) : [el("p", { class: "muted", text: "No stack dumps attached." })]));
    }

    async function openCell(rank, step) {
      heat.marker = { rank, step };
      if (heat.data) heat.draw();
      V.clear(drill).append(el("p", { class: "muted", text: "loading rank " + rank + " at step " + step + "…" }));
      try {
        const c = await V.json(V.apiJob(job) + "/cell?rank=" + rank + "&step=" + step);
        const r = c.record, m = c.median_record;
        const phaseRows = PHASES.map(([k, name]) => [name, V.fmtSeconds(r ? r[k] : null), V.fmtSeconds(m ? m[k] : null), r && m && m[k] > 0 ? "×" + (r[k] / m[k]).toFixed(2) : "–"]);
        const stepTime = (x) => (x ? x.end_s - x.start_s : null);
        phaseRows.unshift(["step", V.fmtSeconds(stepTime(r)), V.fmtSeconds(stepTime(m)), r && m ? "×" + (stepTime(r) / stepTime(m)).toFixed(2) : "–"]);
        const collRows = (list) => list.map((x) => [x.group, x.op, V.fmtNum(x.count, 0), V.fmtBytes(x.bytes), V.fmtSeconds(x.total_device_s), V.fmtSeconds(x.total_wait_s)]);
        const where = c.where || {};
        const lo = Math.max(0, step - 2), hi = step + 2;
        const timelineCanvas = el("canvas", { id: "timeline" });
        V.clear(drill).append(
          el("h3", { id: "drill-title", text: "rank " + rank + " at step " + step + (where.node ? " · node " + where.node : "") + (where.device_uuid ? " · " + where.device_uuid : "") }),
          ...(r ? [] : [el("p", { class: "error", text: "rank " + rank + " reported no step " + step })]),
          el("div", { class: "cols" },
            el("div", {}, el("h4", { text: "Phases (median rank " + (c.median_rank === null ? "–" : c.median_rank) + ")" }), table(["phase", "rank " + rank, "median", "ratio"], phaseRows, { id: "phase-table" })),
            el("div", {}, el("h4", { text: "Collectives of rank " + rank }), table(["group", "op", "count", "bytes", "time", "wait"], collRows(c.collectives), { id: "coll-table" }),
              el("h4", { text: "median rank's" }), table(["group", "op", "count", "bytes", "time", "wait"], collRows(c.median_collectives)))),
          el("h4", { text: "GPU samples of node " + (where.node || "–") + " around this step" }),
          c.gpu_samples.length ? el("div", { class: "charts" }, ...c.gpu_samples.map((s, i) => el("div", { class: "chart" }, el("canvas", { id: "gpu-" + i })))) : el("p", { class: "muted", text: "No samples from this node around this step." }),
          el("h4", {}, "Timeline of steps " + lo + "–" + hi + " (rank " + rank + " and the median rank) ",
            el("button", { type: "button", id: "perfetto", onclick: () => download(lo, hi), text: "Open in Perfetto (download .json.gz)" })),
          el("p", { class: "muted", text: "Open the downloaded file at ui.perfetto.dev or a Perfetto UI of your own (drag and drop); it stays on your machine. vigil does not bundle Perfetto." }),
          el("div", { class: "chart wide" }, timelineCanvas));
        c.gpu_samples.forEach((s, i) => {
          const series = s.series.map((x) => ({ label: x.device || x.node, values: x.points.map((p) => p.mean) }));
          const xs = s.series.length ? s.series[0].points.map((p) => Math.round(p.time_s - (r ? r.start_s : 0))) : [];
          V.lineChart(document.getElementById("gpu-" + i), { title: s.metric + " (s from step start)", x: xs, series: series.slice(0, 4), fmt: (v) => V.fmtNum(v, 2), height: 110 });
        });
        const ranks = [rank, c.median_rank].filter((x) => x !== null);
        const trace = await V.json(V.apiJob(job) + "/timeline?step_start=" + lo + "&step_end=" + hi + "&ranks=" + ranks.join(","));
        V.timeline(timelineCanvas, trace);
        drill.dataset.loaded = rank + ":" + step;
      } catch (e) { V.errorBox(drill, e); }
    }

    async function download(lo, hi) {
      const resp = await V.fetch(V.apiJob(job) + "/trace.json.gz?step_start=" + lo + "&step_end=" + hi);
      const blob = await resp.blob();
      const a = el("a", { download: "vigil-" + job.replace(/[^A-Za-z0-9_.-]/g, "_") + "-steps-" + lo + "-" + hi + ".json.gz" });
      a.href = URL.createObjectURL(blob);
      document.body.append(a);
      a.click();
      setTimeout(() => { URL.revokeObjectURL(a.href); a.remove(); }, 1000);
    }

    let lastSeen = null;
    async function refresh() {
      const o = await V.json(V.apiJob(job));
      renderHead(o);
      const changed = JSON.stringify([o.state.last_step, o.findings.length, o.recovery.length]) !== lastSeen;
      lastSeen = JSON.stringify([o.state.last_step, o.findings.length, o.recovery.length]);
      if (heat.data && changed && heat.following() && !heat.drag) await heat.load().catch((e) => V.errorBox(heatBox.querySelector(".heat-error"), e));
      if (changed) {
        renderFindings(o.findings);
        renderRecovery(o.recovery);
        renderCheckpoints(o.checkpoints);
        await renderHang(o);
        await firstHeat;
        const s = await V.json(V.apiJob(job) + "/series");
        V.lineChart(document.getElementById("chart-step"), { title: "step time", x: s.steps, series: [{ label: "p50", values: s.step_time_p50_s }, { label: "p99", values: s.step_time_p99_s }], fmt: V.fmtSeconds });
        V.lineChart(document.getElementById("chart-mfu"), { title: "MFU", x: s.steps, series: [{ label: "mean", values: s.mfu }], fmt: V.fmtPct });
        V.lineChart(document.getElementById("chart-tokens"), { title: "tokens/s", x: s.steps, series: [{ label: "tokens/s", values: s.tokens_per_s }], fmt: (v) => V.fmtNum(v, 0) });
      }
    }
    const rank = params.get("rank"), step = params.get("step");
    // The heat map is fetched at once, beside the job's description, not after it; the
    // charts' larger reads wait for its first paint.
    const firstHeat = heat.load().catch((e) => V.errorBox(heatBox.querySelector(".heat-error"), e));
    let first = true;
    return V.live(async () => {
      try { await refresh(); } catch (e) { if (first) V.errorBox(head, e); throw e; }
      if (first && rank !== null && step !== null && /^\d+$/.test(rank) && /^\d+$/.test(step)) openCell(Number(rank), Number(step));
      first = false;
    }, 2000);
  };
})();
