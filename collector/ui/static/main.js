// vigil web UI: routing. /ui/ is the jobs page, /ui/jobs/<job>?metric=&step=&rank= a job.
"use strict";
(function () {
  const V = window.vigil;
  V.crumbs = function (parts) {
    const nav = V.clear(document.getElementById("crumbs"));
    nav.append(V.el("a", { href: "/ui/", text: "jobs" }));
    for (const p of parts) nav.append(" / ", V.el("span", { text: p }));
  };
  let stop = null;
  function route() {
    if (stop) stop();
    const main = document.getElementById("main");
    const m = location.pathname.match(/^\/ui\/jobs\/([^/]+)$/);
    if (m) {
      const params = new URLSearchParams(location.search);
      stop = V.jobPage(main, decodeURIComponent(m[1]), params);
    } else {
      stop = V.jobsPage(main);
    }
  }
  V.initToken();
  V.onToken(route);
  route();
})();
