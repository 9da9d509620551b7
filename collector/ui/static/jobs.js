// vigil web UI: the jobs page: every job, newest first, with search and a state filter.
"use strict";
(function () {
  const V = window.vigil;
  const el = V.el;

  V.jobsPage = function (main) {
    V.clear(main);
    const search = el("input", { id: "job-search", type: "search", placeholder: "search jobs", "aria-label": "search jobs" });
    const state = el("select", { id: "job-state", "aria-label": "state" }, ...["", "running", "succeeded", "failed", "unknown"].map((s) => el("option", { value: s, text: s || "any state" })));
    const body = el("tbody");
    const table = el("table", { class: "jobs", id: "jobs-table" },
      el("thead", {}, el("tr", {}, ...["job", "state", "world", "layout", "MFU", "step p50", "tokens/s", "open findings", "last seen"].map((t) => el("th", { text: t })))),
      body);
    const note = el("p", { class: "muted", id: "jobs-note" });
    main.append(el("section", {}, el("div", { class: "toolbar" }, el("h1", { text: "Jobs" }), search, state), table, note));
    let jobs = [];
    const render = () => {
      const q = search.value.trim().toLowerCase();
      const shown = jobs.filter((j) => (!q || j.job_id.toLowerCase().includes(q) || (j.name || "").toLowerCase().includes(q)) && (!state.value || j.state === state.value));
      V.clear(body);
      for (const j of shown) {
        body.append(el("tr", { dataset: { job: j.job_id } },
          el("td", {}, el("a", { href: V.pageJob(j.job_id), class: "job-link", text: j.name && j.name !== j.job_id ? j.name + " (" + j.job_id + ")" : j.job_id })),
          el("td", {}, el("span", { class: "state " + j.state, text: j.state })),
          el("td", { text: V.fmtNum(j.world_size, 0) }),
          el("td", { text: V.fmtLayout(j.layout) }),
          el("td", { text: V.fmtPct(j.mfu) }),
          el("td", { text: V.fmtSeconds(j.step_time_p50_s) }),
          el("td", { text: V.fmtNum(j.tokens_per_s, 0) }),
          el("td", { class: j.open_findings ? "alert" : "", text: String(j.open_findings) }),
          el("td", { text: V.fmtAgo(j.last_seen_s) })));
      }
      note.textContent = shown.length + " of " + jobs.length + " jobs";
    };
    search.addEventListener("input", render);
    state.addEventListener("change", render);
    V.crumbs([]);
    return V.live(async () => { jobs = await V.json("/ui/api/jobs"); render(); }, 3000);
  };
})();
