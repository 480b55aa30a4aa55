// The plots of a ksearch run report, drawn with Chart.js from the data embedded in the page.
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("ksearch-data").textContent);
  var evals = data.evaluations;
  window.ksearchData = data;
  window.ksearchCharts = {};
  Chart.defaults.animation = false;
  Chart.defaults.font.size = 12;

  function label(e) {
    var what = e.purpose === "seed" ? "seed" : "node " + e.node;
    var res = e.ok && e.speedup !== null ? e.speedup.toFixed(2) + "x" : (e.failure || "failed");
    return what + " (round " + e.round + "): " + res;
  }

  var t0 = evals.length ? Date.parse(evals[0].at) : 0;
  function progress(id, xOf, xTitle, xType, integerTicks) {
    var points = evals.map(function (e, i) {
      return { x: xOf(e, i), y: e.best, e: e };
    });
    window.ksearchCharts[id] = new Chart(document.getElementById(id), {
      type: "scatter",
      data: {
        datasets: [{
          label: "best speed-up so far",
          data: points,
          showLine: true,
          stepped: "before",
          borderColor: "#1f6fb4",
          backgroundColor: points.map(function (p) { return p.e.ok ? "#1f6fb4" : "#d0453a"; }),
          pointRadius: 3
        }]
      },
      options: {
        maintainAspectRatio: false,
        scales: {
          x: { type: xType, ticks: integerTicks ? { precision: 0 } : {}, title: { display: true, text: xTitle } },
          y: { title: { display: true, text: "best speed-up over the seed (x)" } }
        },
        plugins: {
          legend: { display: false },
          tooltip: { callbacks: { label: function (c) { return label(c.raw.e) + "; best " + (c.raw.y === null ? "-" : c.raw.y.toFixed(2) + "x"); } } }
        }
      }
    });
  }
  progress("chart-evals", function (e, i) { return i + 1; }, "evaluation", "linear", true);
  progress("chart-time", function (e) { return (Date.parse(e.at) - t0) / 1000; }, "wall time since the seed (s)", "linear", false);

  // Roofline: log-log, one point per evaluated candidate that passed, with the profile's roofs.
  var pts = evals.filter(function (e) { return e.intensity !== null && e.gflops !== null; }).map(function (e) {
    return { x: e.intensity, y: e.gflops, e: e };
  });
  var datasets = [{
    label: "candidates (triangle: the seed)",
    data: pts,
    backgroundColor: "#1f6fb4",
    borderColor: "#1f6fb4",
    pointStyle: pts.map(function (p) { return p.e.purpose === "seed" ? "triangle" : "circle"; }),
    pointRadius: pts.map(function (p) { return p.e.purpose === "seed" ? 6 : 4; })
  }];
  var xs = pts.map(function (p) { return p.x; });
  var roofColours = ["#d0453a", "#7b3fb0"];
  if (data.roofs && data.roofs.bandwidth_gbs > 0) {
    var bw = data.roofs.bandwidth_gbs;
    data.roofs.peaks.forEach(function (p, i) {
      var peak = p.gflops, ridge = peak / bw;
      var lo = Math.min.apply(null, xs.concat([ridge])) / 4, hi = Math.max.apply(null, xs.concat([ridge])) * 4;
      datasets.push({
        label: (i === 0 ? bw + " GB/s, " : "") + peak + " GFLOP/s " + p.dtype + " (" + data.roofs.profile + ")",
        data: [{ x: lo, y: bw * lo }, { x: ridge, y: peak }, { x: hi, y: peak }],
        showLine: true,
        borderColor: roofColours[i % 2],
        backgroundColor: roofColours[i % 2],
        pointRadius: 0,
        fill: false
      });
    });
  }
  if (data.roofs && data.roofs.measured_bandwidth_gbs > 0 && xs.length) {
    var mbw = data.roofs.measured_bandwidth_gbs;
    var mlo = Math.min.apply(null, xs) / 4, mhi = Math.max.apply(null, xs) * 4;
    datasets.push({
      label: "measured copy bandwidth: " + mbw + " GB/s",
      data: [{ x: mlo, y: mbw * mlo }, { x: mhi, y: mbw * mhi }],
      showLine: true,
      borderColor: "#e0a030",
      backgroundColor: "#e0a030",
      borderDash: [6, 4],
      pointRadius: 0,
      fill: false
    });
  }
  // Log axes: a label at each power of ten only.
  function decades(v) {
    var l = Math.log10(v);
    return Math.abs(l - Math.round(l)) < 1e-9 ? (v >= 1 ? v.toLocaleString("en") : v.toPrecision(1)) : "";
  }
  function decadeGrid(ctx) {
    return ctx.tick && decades(ctx.tick.value) !== "" ? "rgba(0,0,0,0.12)" : "rgba(0,0,0,0.03)";
  }
  window.ksearchCharts["chart-roofline"] = new Chart(document.getElementById("chart-roofline"), {
    type: "scatter",
    data: { datasets: datasets },
    options: {
      maintainAspectRatio: false,
      scales: {
        x: { type: "logarithmic", grid: { color: decadeGrid }, ticks: { callback: decades, autoSkip: false, maxRotation: 0 }, title: { display: true, text: "arithmetic intensity (flop/byte)" } },
        y: { type: "logarithmic", grid: { color: decadeGrid }, ticks: { callback: decades, autoSkip: false }, title: { display: true, text: "achieved throughput (GFLOP/s)" } }
      },
      plugins: {
        tooltip: { callbacks: { label: function (c) {
          if (!c.raw.e) { return c.dataset.label; }
          return label(c.raw.e) + "; " + c.raw.x.toPrecision(3) + " flop/byte, " + c.raw.y.toPrecision(3) + " GFLOP/s";
        } } }
      }
    }
  });

  var fail = document.getElementById("chart-failures");
  if (fail) {
    var classes = Object.keys(data.failures);
    window.ksearchCharts["chart-failures"] = new Chart(fail, {
      type: "bar",
      data: { labels: classes, datasets: [{ label: "failed evaluations", data: classes.map(function (c) { return data.failures[c]; }), backgroundColor: "#d0453a" }] },
      options: { maintainAspectRatio: false, plugins: { legend: { display: false } }, scales: { y: { beginAtZero: true, ticks: { precision: 0 } } } }
    });
  }
})();
