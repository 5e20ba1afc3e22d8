// stepwatch web page: draws the run charts with uPlot from the JSON the server embedded
// in #page-data, shades straggler/regression spans, and refreshes the page content
// every 10 s (fetch + swap of <main>, no full reload). No build step, no dependencies
// besides the vendored uPlot.
"use strict";
(function () {
  const REFRESH_MS = 10000;
  const errors = [];
  const charts = [];

  window.addEventListener("error", function (e) {
    errors.push(String(e.message));
    document.body.dataset.errors = errors.join(" | ");
  });

  function fmt(v, unit) {
    if (v == null) return "–";
    if (unit === "%") return (100 * v).toFixed(2) + "%";
    if (unit === "s") return v.toPrecision(3) + " s";
    return Math.round(v).toLocaleString("en-US");
  }

  function shade(spans) {
    return function (u) {
      const ctx = u.ctx;
      const top = u.bbox.top, height = u.bbox.height;
      ctx.save();
      for (const s of spans) {
        const x0 = u.valToPos(s.first_step, "x", true);
        const x1 = u.valToPos(s.last_step, "x", true);
        ctx.fillStyle = s.kind === "straggler" ? "rgba(214, 69, 69, 0.12)" : "rgba(224, 160, 48, 0.15)";
        ctx.fillRect(Math.min(x0, x1), top, Math.max(2, Math.abs(x1 - x0)), height);
      }
      ctx.restore();
    };
  }

  function plot(id, seriesList, unit, spans) {
    const el = document.getElementById(id);
    if (!el) return 0;
    const first = seriesList.find(function (s) { return s.data && s.data.step.length; });
    if (!first) {
      const why = seriesList.map(function (s) { return s.data && s.data.reason; }).find(Boolean);
      el.innerHTML = '<p class="empty"></p>';
      el.firstChild.textContent = why || "no data yet";
      el.dataset.points = "0";
      return 0;
    }
    const xs = first.data.step;
    const data = [xs];
    const series = [{ label: "step" }];
    for (const s of seriesList) {
      if (!s.data || s.data.step.length !== xs.length) continue;
      data.push(s.data.mean);
      series.push({ label: s.label, stroke: s.color, width: 1.5, value: function (u, v) { return fmt(v, unit); } });
    }
    const opts = {
      width: Math.max(280, el.clientWidth || 400),
      height: 190,
      series: series,
      // From zero: a rate that barely moves still gets a readable axis with several ticks
      // (auto-ranging around a flat line leaves one), and a drop reads at its true size.
      scales: { x: { time: false }, y: { range: function (u, lo, hi) { return [0, hi > 0 ? hi * 1.15 : 1]; } } },
      axes: [
        { label: "step" },
        {
          size: 64,
          values: function (u, vals) {
            const out = vals.map(function (v) { return fmt(v, unit); });
            el.dataset.yticks = String(new Set(out).size);
            return out;
          },
        },
      ],
      legend: { live: false },
      hooks: { drawAxes: [shade(spans)] },
    };
    el.innerHTML = "";
    charts.push(new uPlot(opts, data, el));
    el.dataset.points = String(xs.length);
    return 1;
  }

  function draw() {
    while (charts.length) charts.pop().destroy();
    const holder = document.getElementById("page-data");
    if (!holder) {
      document.body.dataset.charts = "0";
      return;
    }
    const page = JSON.parse(holder.dataset.json);
    const c = page.charts;
    const spans = page.events.filter(function (e) { return e.kind === "straggler" || e.kind === "regression"; });
    let drawn = 0;
    drawn += plot("chart-mfu", [{ label: "MFU", color: "#3b6fd6", data: c.mfu }], "%", spans);
    drawn += plot("chart-tps", [{ label: "tokens/s", color: "#3b8c5a", data: c.tokens_per_s }], "", spans);
    drawn += plot(
      "chart-step",
      [
        // The slowest rank first, so the mean is drawn over it (equal with one rank).
        { label: "slowest rank", color: "#d64545", data: c.step_time_max_s },
        { label: "mean over ranks", color: "#7a4fc9", data: c.step_time_s },
      ],
      "s",
      spans
    );
    document.body.dataset.charts = String(drawn);
  }

  function refresh() {
    if (document.hidden || new URLSearchParams(location.search).has("static")) return;
    const live = document.getElementById("live");
    fetch(location.href, { cache: "no-store" })
      .then(function (r) { if (!r.ok) throw new Error("HTTP " + r.status); return r.text(); })
      .then(function (html) {
        const doc = new DOMParser().parseFromString(html, "text/html");
        const main = doc.getElementById("main");
        if (main) {
          document.getElementById("main").innerHTML = main.innerHTML;
          draw();
        }
        if (live) live.className = "live";
      })
      .catch(function () { if (live) live.className = "live offline"; });
  }

  let resizeTimer = null;
  window.addEventListener("resize", function () {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(draw, 200);
  });
  draw();
  setInterval(refresh, REFRESH_MS);
})();
