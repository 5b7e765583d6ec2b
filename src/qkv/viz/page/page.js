/* qkv's offline attention page. The one place where attention is computed outside qkv's Python stages;
   tests/browser/ checks every displayed number against qkv (qkv.attention with a Trace).
   All user text goes into the page with textContent / value, never as HTML. */
(function () {
  "use strict";

  var DATA = JSON.parse(document.getElementById("qkv-data").textContent);
  var DIGITS = DATA.digits || 4;                 // decimals shown in the matrix cells
  var MINUS = "\u2212";
  // The page's words, from qkv's locale files (qkv/locales/<lang>.json, the "page." keys), embedded by page.py.
  var STRINGS = DATA.strings || {};
  function msg(key, args) {
    var s = Object.prototype.hasOwnProperty.call(STRINGS, key) ? STRINGS[key] : key;
    return s.replace(/\{(\w+)\}/g, function (m, name) {
      return args && Object.prototype.hasOwnProperty.call(args, name) ? String(args[name]) : m;
    });
  }

  // ------------------------------------------------------------------ small helpers
  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    if (attrs) { for (var k in attrs) { if (attrs[k] !== null && attrs[k] !== undefined) e.setAttribute(k, attrs[k]); } }
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function svgEl(tag, attrs, text) {
    var e = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = String(text);
    return e;
  }
  function clone(m) { return m.map(function (r) { return r.slice(); }); }
  function zeros(n, m) { var out = []; for (var i = 0; i < n; i++) { out.push(new Array(m).fill(0)); } return out; }

  // x.toFixed(p), but an exact tie rounds half to even as Python's format() does (ties are odd / 2^(p+1)).
  function toFixedEven(x, p) {
    var t = x * Math.pow(2, p + 1);
    if (Number.isInteger(t) && Math.abs(t % 2) === 1) {
      var lo = Math.floor(x * Math.pow(10, p));            // exact: x·10^p = k + 0.5
      return ((lo % 2 === 0 ? lo : lo + 1) / Math.pow(10, p)).toFixed(p);
    }
    return x.toFixed(p);
  }
  // A matrix cell: fixed decimals, ASCII minus, never "-0.0000".
  function cellText(x) {
    if (x === -Infinity) return "-\u221e";
    if (x === Infinity) return "\u221e";
    if (Number.isNaN(x)) return "NaN";
    var s = toFixedEven(x, DIGITS);
    if (/^-0\.?0*$/.test(s)) s = s.slice(1);
    return s;
  }
  // A number in the arithmetic exactly as qkv explain writes it (qkv.explain._doc.fmt, precision 4):
  // rounded to 4 decimals, trailing zeros dropped but one kept (0.39, 1.0), 0, −0.5, tiny ones as 3.2e−5.
  function num(x) {
    var p = 4, s;
    if (Number.isNaN(x)) return "NaN";
    if (!Number.isFinite(x)) return x < 0 ? MINUS + "\u221e" : "\u221e";
    if (x === 0) return "0";
    if (Math.abs(x) < 0.5 * Math.pow(10, -p)) {
      var parts = x.toExponential(Math.max(p - 2, 1)).split("e"), mant = parts[0];
      if (mant.indexOf(".") >= 0) mant = mant.replace(/0+$/, "").replace(/\.$/, "");
      return (mant + "e" + String(parseInt(parts[1], 10))).replace(/-/g, MINUS);
    }
    s = toFixedEven(x, p);
    if (s.indexOf(".") >= 0) { s = s.replace(/0+$/, ""); if (s.endsWith(".")) s += "0"; }
    if (s === "-0.0" || s === "0.0") s = "0";
    return s.replace(/-/g, MINUS);
  }
  function factor(x) { var s = num(x); return s.charAt(0) === MINUS ? "(" + s + ")" : s; }
  // "lhs = a×b + c×d + … = r", as qkv explain's product lines (more than 8 terms: the first 3 and a count).
  function productLine(lhs, pairs, result) {
    var show = pairs.length <= 8 ? pairs : pairs.slice(0, 3);
    var expr = show.map(function (p) { return factor(p[0]) + "\u00d7" + factor(p[1]); }).join(" + ");
    if (pairs.length > 8) expr += " + " + msg("page.terms", { n: pairs.length });
    return lhs + " = " + expr + " = " + num(result);
  }
  // qkv explain's softmax lines for query row i, then the one division that gives weights[i][j].
  function softmaxLines(label, keyLabels, x, soft, j) {
    var C = x.length, show = C <= 8 ? C : 6, parts = [], k;
    for (k = 0; k < show; k++) {
      parts.push(x[k] === -Infinity ? "exp(" + MINUS + "\u221e) = 0"
                                    : "exp(" + num(x[k]) + " " + MINUS + " " + factor(soft.max) + ") = " + num(soft.exp[k]));
    }
    var lines = [msg("page.row", { label: label }) + ": " + msg("page.max") + " = " + num(soft.max),
                 "  " + parts.join(";  ") + (C > show ? "; \u2026" : "")];
    var sum = "  " + msg("page.sum") + " = ", plusSink = "";
    if (soft.sink !== null && soft.sink !== undefined) {
      lines.push("  " + msg("page.sink") + ": exp(" + num(soft.sink) + " " + MINUS + " " + factor(soft.max) + ") = " +
                 num(soft.sinkExp));
      plusSink = " + " + num(soft.sinkExp);
    }
    lines.push(C <= 8 ? sum + soft.exp.map(num).join(" + ") + plusSink + " = " + num(soft.sum)
                      : sum + "\u03a3 (" + C + ")" + plusSink + " = " + num(soft.sum));
    lines.push("  " + keyLabels[j] + ": " + num(soft.exp[j]) + " / " + num(soft.sum) + " = " + num(soft.w[j]));
    return lines.join("\n");
  }

  // ------------------------------------------------------------------ the computation
  function matmul(A, B) {
    var n = A.length, k = B.length, m = B[0].length, C = zeros(n, m);
    for (var i = 0; i < n; i++) {
      for (var j = 0; j < m; j++) {
        var s = 0;
        for (var t = 0; t < k; t++) s += A[i][t] * B[t][j];
        C[i][j] = s;
      }
    }
    return C;
  }
  function columns(A, a, b) { return A.map(function (r) { return r.slice(a, b); }); }
  function transpose(A) { return A[0].map(function (_, j) { return A.map(function (r) { return r[j]; }); }); }
  // qkv.stages.softmax: a row with nothing allowed becomes zeros; a sink logit joins the max and the denominator.
  function softmaxRow(row, sink) {
    var m = Math.max.apply(null, row), hasSink = sink !== null && sink !== undefined;
    if (hasSink) m = Math.max(m, sink);
    if (!Number.isFinite(m)) m = 0;
    var e = row.map(function (x) { return Math.exp(x - m); });
    var total = e.reduce(function (a, b) { return a + b; }, 0);
    var sinkExp = hasSink ? Math.exp(sink - m) : null;
    if (hasSink) total += sinkExp;
    return { max: m, exp: e, sum: total, sink: hasSink ? sink : null, sinkExp: sinkExp,
             w: e.map(function (x) { return x / (total === 0 ? 1 : total); }) };
  }
  // ALiBi's head slopes (qkv.mods.alibi_slopes): 2^(−8(h+1)/n) for a power of two n, then every other of 2n.
  function alibiSlopes(H) {
    function pow2(n) { var out = []; for (var i = 0; i < n; i++) out.push(Math.pow(2, -8 * (i + 1) / n)); return out; }
    var n = Math.pow(2, Math.floor(Math.log2(H))), out = pow2(n);
    if (n < H) out = out.concat(pow2(2 * n).filter(function (_, i) { return i % 2 === 0; }).slice(0, H - n));
    return out;
  }
  // RoPE (qkv.positions.rope): the pair (a, b) of row t turns by positions[t] × θ_i, θ_i = theta^(−2i/E).
  function ropePair(rope, E, i) {
    return rope.style === "interleaved" ? [2 * i, 2 * i + 1] : [i, i + E / 2];
  }
  function ropeRows(M, positions, rope) {
    var E = M[0].length;
    return M.map(function (row, t) {
      var out = row.slice();
      for (var i = 0; i < E / 2; i++) {
        var ab = ropePair(rope, E, i), phi = positions[t] * (1 / Math.pow(rope.theta, (2 * i) / E));
        var c = Math.cos(phi), s = Math.sin(phi);
        out[ab[0]] = row[ab[0]] * c - row[ab[1]] * s;
        out[ab[1]] = row[ab[1]] * c + row[ab[0]] * s;
      }
      return out;
    });
  }
  function range(n) { var out = []; for (var i = 0; i < n; i++) out.push(i); return out; }

  // st.start: "X" (token vectors and projections), "QK" (Q, K and maybe V given) or "scores" (scores given).
  function compute(st) {
    var Q = null, K = null, V = null;
    if (st.start === "X") {
      var Xkv = st.X_kv || st.X;
      Q = matmul(st.X, st.W_Q); K = matmul(Xkv, st.W_K); V = matmul(Xkv, st.W_V);
    } else if (st.start === "QK") {
      Q = st.Q; K = st.K; V = st.V;
    } else {
      V = st.V;
    }
    var L = st.start === "scores" ? st.scores.length : Q.length;
    var S = st.start === "scores" ? st.scores[0].length : K.length;
    var H = st.heads, E = Q ? Q[0].length / H : null, Ev = V ? V[0].length / H : null;
    var allowed = [];
    for (var i = 0; i < L; i++) {
      allowed.push([]);
      for (var j = 0; j < S; j++) {
        var ok = st.mask ? !!st.mask[i][j] : true;
        if (st.causal && j > i) ok = false;     // top-left causal, as torch's is_causal
        allowed[i].push(ok);
      }
    }
    // d_k: the example's own d_k while the heads are as it gave them, otherwise the width of one head.
    var d_k = (st.d_k !== null && st.heads === initial.heads) ? st.d_k : E;
    var scale = st.scaling ? 1 / Math.sqrt(d_k) : 1;
    // The variants, as the worked example gives them: RoPE, ALiBi slopes (one per head), softcap, sink logits.
    var rope = st.start !== "scores" ? st.rope : null;
    var qPos = rope && (rope.positions || range(L));
    var kPos = rope && (rope.kv_positions || (st.kv_tokens || S !== L ? range(S) : qPos));
    var slopes = st.alibi === "auto" ? alibiSlopes(H) : (st.alibi && st.alibi.length === H ? st.alibi
                                                        : (st.alibi ? alibiSlopes(H) : null));
    var sinks = st.sink_logits ? range(H).map(function (h) { return st.sink_logits[h % st.sink_logits.length]; }) : null;
    var heads = [];
    for (var h = 0; h < H; h++) {
      var Qh = Q && columns(Q, h * E, (h + 1) * E), Kh = K && columns(K, h * E, (h + 1) * E);
      var Vh = V && columns(V, h * Ev, (h + 1) * Ev), Qr = null, Kr = null;
      if (rope) { Qr = ropeRows(Qh, qPos, rope); Kr = ropeRows(Kh, kPos, rope); }
      var scores = st.start === "scores" ? st.scores : matmul(Qr || Qh, transpose(Kr || Kh));
      var scaled = scores.map(function (r) { return r.map(function (x) { return x * scale; }); });
      var biased = slopes ? scaled.map(function (r, i) {
        return r.map(function (x, j) { return x + slopes[h] * (j - i); });
      }) : null;
      var capped = st.softcap ? (biased || scaled).map(function (r) {
        return r.map(function (x) { return st.softcap * Math.tanh(x / st.softcap); });
      }) : null;
      var logits = capped || biased || scaled;
      var soft = logits.map(function (r, i) {
        return softmaxRow(r.map(function (x, j) { return allowed[i][j] ? x : -Infinity; }), sinks ? sinks[h] : null);
      });
      var weights = soft.map(function (s) { return s.w; });
      heads.push({ Q: Qr || Qh, K: Kr || Kh, Q_in: Qh, K_in: Kh, V: Vh, scores: scores, scaled: scaled,
                   biased: biased, capped: capped, logits: logits, slope: slopes ? slopes[h] : null, soft: soft,
                   weights: weights, output: Vh ? matmul(weights, Vh) : null });
    }
    var output = null;
    if (V) {
      output = [];
      for (i = 0; i < L; i++) {
        output.push([]);
        for (h = 0; h < H; h++) output[i] = output[i].concat(heads[h].output[i]);
      }
    }
    var final = st.W_O && output ? matmul(output, st.W_O) : null;
    return { Q: Q, K: K, V: V, E: E, Ev: Ev, d_k: d_k, scale: scale, allowed: allowed, heads: heads, output: output,
             final: final, L: L, S: S, rope: rope, qPos: qPos, kPos: kPos };
  }

  // ------------------------------------------------------------------ state
  var initial = DATA.playground;
  var state = null;
  function resetState() {
    function copy(m) { return m ? clone(m) : null; }
    state = {
      title: initial.title || msg("page.playground_title"), start: initial.start || "X",
      tokens: initial.tokens.slice(), kv_tokens: initial.kv_tokens ? initial.kv_tokens.slice() : null,
      X: copy(initial.X), X_kv: copy(initial.X_kv), W_Q: copy(initial.W_Q), W_K: copy(initial.W_K),
      W_V: copy(initial.W_V), Q: copy(initial.Q), K: copy(initial.K), V: copy(initial.V),
      scores: copy(initial.scores), W_O: copy(initial.W_O), mask: copy(initial.mask),
      d_k: initial.d_k === undefined ? null : initial.d_k,
      heads: initial.heads || 1, causal: !!initial.causal, scaling: initial.scaling !== false, shown: 0,
      rope: initial.rope || null, alibi: initial.alibi || null, softcap: initial.softcap || null,
      sink_logits: initial.sink_logits || null, invalid: {}
    };
  }
  function keyTokens() { return state.kv_tokens || state.tokens; }
  function headChoices() {                // several heads only from token vectors (the projections split)
    if (state.start !== "X") return [1];
    var E = state.W_Q[0].length, Ev = state.W_V[0].length, out = [];
    for (var h = 1; h <= Math.min(E, Ev); h++) { if (E % h === 0 && Ev % h === 0) out.push(h); }
    return out;
  }

  var NUMBER = /^\s*[+\-\u2212]?(\d+\.?\d*|\.\d+)([eE][+\-]?\d+)?\s*$/;
  function parseNumber(text) {
    if (!NUMBER.test(text)) return null;
    var x = Number(text.trim().replace("\u2212", "-"));
    return Number.isFinite(x) ? x : null;
  }

  // ------------------------------------------------------------------ rendering
  var arith = document.getElementById("arith");
  function explainOn(node, text) {
    node.title = text;
    node.addEventListener("mouseenter", function () { arith.textContent = text; });
    node.addEventListener("focus", function () { arith.textContent = text; });
  }

  // A table: caption, column header, one row per token. cell(i, j, td) fills each data cell.
  function table(name, caption, formula, rowLabels, colLabels, cell, extraClass) {
    var t = el("table", { "class": "matrix" + (extraClass ? " " + extraClass : ""), "data-testid": name + "-table",
                          "data-matrix": name });
    var cap = el("caption", null, caption);
    if (formula) cap.appendChild(el("span", { "class": "formula" }, formula));
    t.appendChild(cap);
    var thead = el("thead"), hr = el("tr");
    hr.appendChild(el("th"));
    colLabels.forEach(function (c, j) { hr.appendChild(el("th", { "data-testid": name + "-col-" + j }, c)); });
    thead.appendChild(hr);
    t.appendChild(thead);
    var tbody = el("tbody");
    rowLabels.forEach(function (r, i) {
      var tr = el("tr");
      tr.appendChild(el("th", { "scope": "row", "data-testid": name + "-row-" + i }, r));
      colLabels.forEach(function (_, j) {
        var td = el("td");
        cell(i, j, td);
        if (!td.firstElementChild) td.setAttribute("data-testid", name + "-" + i + "-" + j);  // inputs carry their own
        tr.appendChild(td);
      });
      tbody.appendChild(tr);
    });
    t.appendChild(tbody);
    return t;
  }
  function indexLabels(n, prefix) { var out = []; for (var i = 0; i < n; i++) out.push((prefix || "") + i); return out; }

  function inputTable(name, caption, rowLabels, colLabels) {
    var M = state[name];
    return table(name, caption, null, rowLabels, colLabels, function (i, j, td) {
      td.className = "in";
      var inp = el("input", { "type": "text", "inputmode": "decimal", "spellcheck": "false", "autocomplete": "off",
                              "data-testid": name + "-" + i + "-" + j, "aria-label": name + "[" + i + "," + j + "]" });
      inp.value = String(Number(M[i][j].toPrecision(12)));   // shown short; the exact value stays in the state
      inp.addEventListener("input", function () {
        var x = parseNumber(inp.value), key = name + "-" + i + "-" + j;
        if (x === null) {
          inp.classList.add("invalid"); td.classList.add("invalid");
          inp.setAttribute("aria-invalid", "true");
          state.invalid[key] = true;
        } else {
          inp.classList.remove("invalid"); td.classList.remove("invalid");
          inp.removeAttribute("aria-invalid");
          delete state.invalid[key];
          M[i][j] = x;
        }
        update();
      });
      explainOn(inp, msg("page.input_hint", { cell: name + "[" + i + "," + j + "]" }));
      td.appendChild(inp);
    });
  }

  function renderControls() {
    var c = document.getElementById("controls");
    c.textContent = "";
    var causal = el("input", { "type": "checkbox", "data-testid": "toggle-causal", "id": "toggle-causal" });
    causal.checked = state.causal;
    causal.addEventListener("change", function () { state.causal = causal.checked; update(); });
    var l1 = el("label", { "for": "toggle-causal" }); l1.appendChild(causal); l1.appendChild(document.createTextNode(msg("page.causal")));
    var scale = el("input", { "type": "checkbox", "data-testid": "toggle-scale", "id": "toggle-scale" });
    scale.checked = state.scaling;
    scale.addEventListener("change", function () { state.scaling = scale.checked; update(); });
    var l2 = el("label", { "for": "toggle-scale" }); l2.appendChild(scale); l2.appendChild(document.createTextNode(msg("page.scale")));
    var sel = el("select", { "data-testid": "heads-select", "id": "heads-select" });
    headChoices().forEach(function (h) { var o = el("option", { "value": String(h) }, String(h)); if (h === state.heads) o.selected = true; sel.appendChild(o); });
    sel.addEventListener("change", function () { state.heads = Number(sel.value); state.shown = 0; update(); });
    var l3 = el("label", { "for": "heads-select" }, msg("page.heads")); l3.appendChild(sel);
    var reset = el("button", { "type": "button", "data-testid": "reset" }, msg("page.reset"));
    reset.addEventListener("click", function () { resetState(); renderAll(); });
    [l1, l2, l3, reset].forEach(function (n) { c.appendChild(n); });
  }

  function renderInputs() {
    var box = document.getElementById("inputs");
    box.textContent = "";
    var toks = el("div", { "class": "tokens", "data-testid": "tokens" });
    toks.appendChild(el("h3", null, msg("page.tokens")));
    state.tokens.forEach(function (t, i) {
      var inp = el("input", { "type": "text", "data-testid": "token-" + i, "aria-label": msg("page.token_label", { i: i }) });
      inp.value = t;
      inp.addEventListener("input", function () { state.tokens[i] = inp.value; relabel(); update(); });
      toks.appendChild(inp);
    });
    if (state.kv_tokens) {
      toks.appendChild(el("h3", null, msg("page.kv_tokens")));
      state.kv_tokens.forEach(function (t, i) {
        var inp = el("input", { "type": "text", "data-testid": "kv-token-" + i, "aria-label": msg("page.kv_token_label", { i: i }) });
        inp.value = t;
        inp.addEventListener("input", function () { state.kv_tokens[i] = inp.value; relabel(); update(); });
        toks.appendChild(inp);
      });
    }
    box.appendChild(toks);
    var kt = keyTokens();
    if (state.start === "X") {
      var D = state.X[0].length, Dkv = (state.X_kv || state.X)[0].length;
      box.appendChild(inputTable("X", msg("page.X_caption"), state.tokens, indexLabels(D)));
      if (state.X_kv) box.appendChild(inputTable("X_kv", msg("page.X_kv_caption"), kt, indexLabels(Dkv)));
      box.appendChild(inputTable("W_Q", "W_Q", indexLabels(D), indexLabels(state.W_Q[0].length)));
      box.appendChild(inputTable("W_K", "W_K", indexLabels(Dkv), indexLabels(state.W_K[0].length)));
      box.appendChild(inputTable("W_V", "W_V", indexLabels(Dkv), indexLabels(state.W_V[0].length)));
    } else if (state.start === "QK") {
      box.appendChild(inputTable("Q", msg("page.given", { name: "Q" }), state.tokens, indexLabels(state.Q[0].length)));
      box.appendChild(inputTable("K", msg("page.given", { name: "K" }), kt, indexLabels(state.K[0].length)));
      if (state.V) box.appendChild(inputTable("V", msg("page.given", { name: "V" }), kt, indexLabels(state.V[0].length)));
    } else {
      box.appendChild(inputTable("scores", msg("page.given", { name: "scores" }), state.tokens, kt));
      if (state.V) box.appendChild(inputTable("V", msg("page.given", { name: "V" }), kt, indexLabels(state.V[0].length)));
    }
    if (state.start !== "X") {
      box.appendChild(el("p", { "class": "note", "data-testid": "start-note" },
        msg(state.start === "QK" ? (state.d_k !== null ? "page.start_qk_dk" : "page.start_qk")
                                 : (state.d_k !== null ? "page.start_scores_dk" : "page.start_scores"),
            { d_k: String(state.d_k) })));
    }
  }

  // Token labels changed: rewrite the row/column headers of the input tables (update() redraws the results).
  function relabel() {
    var kt = keyTokens();
    ["X", "Q", "scores"].forEach(function (name) {
      state.tokens.forEach(function (t, i) {
        var th = document.querySelector('#inputs [data-testid="' + name + '-row-' + i + '"]');
        if (th) th.textContent = t;
      });
    });
    kt.forEach(function (t, i) {
      ["X_kv-row-", "K-row-", "V-row-", "scores-col-"].forEach(function (prefix) {
        var th = document.querySelector('#inputs [data-testid="' + prefix + i + '"]');
        if (th) th.textContent = t;
      });
    });
  }

  function numberCell(td, x, text) { td.textContent = cellText(x); td.tabIndex = 0; explainOn(td, text); }

  function renderResults() {
    var r = compute(state), box = document.getElementById("results");
    box.textContent = "";
    var toks = state.tokens, ktoks = keyTokens(), H = state.heads, E = r.E, Ev = r.Ev;
    var xkv = state.X_kv ? "X_kv" : "X";
    function projection(name, src, W, M, width) {
      return table(name, name, name + " = " + (name === "Q" ? "X" : xkv) + " · W_" + name,
                   name === "Q" ? toks : ktoks, indexLabels(M[0].length), function (i, j, td) {
        var pairs = src[i].map(function (x, t) { return [x, W[t][j]]; });
        numberCell(td, M[i][j], productLine(name + "[" + (name === "Q" ? toks : ktoks)[i] + ", " + j + "]", pairs, M[i][j]));
        if (H > 1 && Math.floor(j / width) % 2 === 1) td.classList.add("head-alt");
      });
    }
    if (state.start === "X") {
      var proj = el("div", { "class": "matrices" });
      proj.appendChild(projection("Q", state.X, state.W_Q, r.Q, E));
      proj.appendChild(projection("K", state.X_kv || state.X, state.W_K, r.K, E));
      proj.appendChild(projection("V", state.X_kv || state.X, state.W_V, r.V, Ev));
      box.appendChild(proj);
    }

    // Heads: which head's scores / scaled / mask / weights are shown.
    var shown = Math.min(state.shown, H - 1), hd = r.heads[shown];
    var tabs = el("div", { "class": "tabs" });
    if (H > 1) {
      tabs.appendChild(el("span", null, msg("page.show_head")));
      for (var h = 0; h < H; h++) {
        (function (h) {
          var b = el("button", { "type": "button", "data-testid": "head-tab-" + h, "aria-pressed": String(h === shown) }, String(h));
          b.addEventListener("click", function () { state.shown = h; update(); });
          tabs.appendChild(b);
        })(h);
      }
      var cols = function (a, n) { return n === 1 ? msg("page.column", { a: a }) : msg("page.columns", { a: a, b: a + n - 1 }); };
      tabs.appendChild(el("span", { "class": "note", "data-testid": "head-note" },
        msg(state.W_O ? "page.head_note_wo" : "page.head_note",
            { h: shown, qk: cols(shown * E, E), v: cols(shown * Ev, Ev), d_k: String(r.d_k) })));
    }
    box.appendChild(tabs);
    var hs = H > 1 ? msg("page.head_suffix", { h: shown }) : "", hp = H > 1 ? msg("page.head_prefix", { h: shown }) : "";
    if (r.rope) {                           // Q and K turned pair by pair by position × θ_i (this head)
      var rot = el("div", { "class": "matrices" });
      [["Q_rot", hd.Q_in, hd.Q, r.qPos, toks], ["K_rot", hd.K_in, hd.K, r.kPos, ktoks]].forEach(function (x) {
        var name = x[0], src = x[1], M = x[2], pos = x[3], labels = x[4];
        rot.appendChild(table(name, name + hs, msg("page.rope_formula", { name: name.charAt(0), theta: num(r.rope.theta),
                                                                          style: r.rope.style }),
                              labels, indexLabels(M[0].length), function (i, c, td) {
          var Eh = M[0].length, k, ab;
          for (k = 0; k < Eh / 2; k++) { ab = ropePair(r.rope, Eh, k); if (ab[0] === c || ab[1] === c) break; }
          var th = 1 / Math.pow(r.rope.theta, (2 * k) / Eh), phi = pos[i] * th, co = Math.cos(phi), si = Math.sin(phi);
          var a = src[i][ab[0]], b = src[i][ab[1]];
          numberCell(td, M[i][c], hp + name + "[" + labels[i] + ", (" + ab[0] + ", " + ab[1] + ")]: \u03c6 = " + pos[i] +
                     " \u00d7 " + num(th) + " = " + num(phi) + " rad, cos \u03c6 = " + num(co) + ", sin \u03c6 = " + num(si) +
                     "\n  = (" + factor(a) + "\u00d7" + factor(co) + " " + MINUS + " " + factor(b) + "\u00d7" + factor(si) + ", " +
                     factor(b) + "\u00d7" + factor(co) + " + " + factor(a) + "\u00d7" + factor(si) + ") = (" +
                     num(M[i][ab[0]]) + ", " + num(M[i][ab[1]]) + ")");
        }));
      });
      box.appendChild(rot);
    }
    var attn = el("div", { "class": "matrices" });
    if (state.start !== "scores") {
      attn.appendChild(table("scores", "scores" + hs, "= Q·Kᵀ", toks, ktoks, function (i, j, td) {
        var pairs = hd.Q[i].map(function (q, t) { return [q, hd.K[j][t]]; });
        numberCell(td, hd.scores[i][j], hp + productLine("scores[" + toks[i] + ", " + ktoks[j] + "]", pairs, hd.scores[i][j]));
      }));
    }
    attn.appendChild(table("scaled", "scaled" + hs, state.scaling ? "= scores ÷ √d_k" : msg("page.scaling_off"), toks, ktoks, function (i, j, td) {
      var s = hd.scores[i][j], v = hd.scaled[i][j];
      var text = hp + "scaled[" + toks[i] + ", " + ktoks[j] + "] = " + num(s) +
                 (state.scaling ? " / " + num(Math.sqrt(r.d_k)) : " \u00d7 " + num(1.0)) + " = " + num(v);
      if (!r.allowed[i][j]) td.classList.add("masked");     // struck through: −∞ before softmax (see the mask)
      numberCell(td, v, text);
    }));
    if (hd.biased) {
      attn.appendChild(table("biased", "biased" + hs, "= scaled + m_h\u00b7(j " + MINUS + " i)", toks, ktoks, function (i, j, td) {
        var d = j - i, dist = d < 0 ? "(" + MINUS + (-d) + ")" : String(d);
        numberCell(td, hd.biased[i][j], hp + "biased[" + toks[i] + ", " + ktoks[j] + "] = " + num(hd.scaled[i][j]) + " + " +
                   factor(hd.slope) + "\u00d7" + dist + " = " + num(hd.biased[i][j]));
      }));
    }
    if (hd.capped) {
      var c = state.softcap, cc = num(c);
      attn.appendChild(table("capped", "capped" + hs, msg("page.softcap_formula", { cap: cc }), toks, ktoks, function (i, j, td) {
        var s = (hd.biased || hd.scaled)[i][j], v = hd.capped[i][j];
        numberCell(td, v, hp + "capped[" + toks[i] + ", " + ktoks[j] + "] = " + cc + "\u00b7tanh(" + num(s) + " / " + cc +
                   ") = " + cc + "\u00b7tanh(" + num(s / c) + ") = " + cc + "\u00d7" + factor(v / c) + " = " + num(v));
      }));
    }
    attn.appendChild(table("mask", "mask", msg("page.may_attend"), toks, ktoks, function (i, j, td) {
      td.textContent = r.allowed[i][j] ? "1" : "0";
      td.tabIndex = 0;
      explainOn(td, "mask[" + toks[i] + ", " + ktoks[j] + "] = " + (r.allowed[i][j] ? msg("page.mask_yes") : msg("page.mask_no")));
    }));
    var last = hd.capped ? "capped" : hd.biased ? "biased" : "scaled";
    attn.appendChild(table("weights", "weights" + hs, "= softmax(" + last + ")", toks, ktoks, function (i, j, td) {
      var w = hd.weights[i][j];
      var logits = hd.logits[i].map(function (x, k) { return r.allowed[i][k] ? x : -Infinity; });
      var text = hp + softmaxLines(toks[i], ktoks, logits, hd.soft[i], j);
      numberCell(td, w, text);
      td.style.backgroundColor = "rgba(37, 99, 235, " + Math.max(0, Math.min(1, w)) * 0.55 + ")";
    }));
    box.appendChild(attn);

    if (!r.output) return;                  // an example without V stops at the weights
    var outs = el("div", { "class": "matrices" });
    var outCaption = H > 1 ? msg("page.output_concat") : "output";
    outs.appendChild(table("output", outCaption, H > 1 ? "= [weights_h · V_h for each head h]" : "= weights · V", toks,
                           indexLabels(r.output[0].length), function (i, j, td) {
      var h = Math.floor(j / Ev), c = j % Ev, hh = r.heads[h];
      var pairs = hh.weights[i].map(function (w, t) { return [w, hh.V[t][c]]; });
      numberCell(td, r.output[i][j], (H > 1 ? msg("page.head_prefix", { h: h }) : "") + productLine("output[" + toks[i] + ", " + c + "]", pairs, r.output[i][j]));
      if (H > 1 && h % 2 === 1) td.classList.add("head-alt");
    }));
    if (r.final) {
      outs.appendChild(table("final_output", msg("page.final_output"), "= output · W_O", toks, indexLabels(r.final[0].length), function (i, j, td) {
        var pairs = r.output[i].map(function (x, t) { return [x, state.W_O[t][j]]; });
        numberCell(td, r.final[i][j], productLine("final_output[" + toks[i] + ", " + j + "]", pairs, r.final[i][j]));
      }));
    }
    box.appendChild(outs);
  }

  function updateStatus() {
    var bad = Object.keys(state.invalid).length, status = document.getElementById("status");
    status.textContent = bad === 0 ? "" : msg(bad === 1 ? "page.invalid_one" : "page.invalid_many", { n: bad });
  }
  function update() {
    document.getElementById("title").textContent = state.title;
    updateStatus();
    renderResults();
  }
  function renderAll() { renderControls(); renderInputs(); update(); }

  // ------------------------------------------------------------------ model view
  function renderModel(M) {
    var sec = document.getElementById("model");
    sec.hidden = false;
    sec.appendChild(el("h2", null, msg("page.model_title", { name: M.name })));
    var p = el("p", { "class": "note", "data-testid": "model-text" });
    p.textContent = msg("page.sentence", { text: M.text });
    sec.appendChild(p);
    sec.appendChild(el("p", { "class": "note" }, msg("page.model_note")));
    var T = M.tokens.length, sel = { layer: 0, head: 0 };
    var grid = el("table", { "class": "grid", "data-testid": "model-grid" });
    var hr = el("tr"); hr.appendChild(el("th"));
    for (var h = 0; h < M.heads; h++) hr.appendChild(el("th", null, msg("page.head", { h: h })));
    grid.appendChild(hr);
    var thumbs = [];
    for (var l = 0; l < M.layers; l++) {
      var tr = el("tr"); tr.appendChild(el("th", null, msg("page.layer", { l: l })));
      for (h = 0; h < M.heads; h++) {
        (function (l, h) {
          var b = el("button", { "type": "button", "class": "thumb", "data-testid": "thumb-" + l + "-" + h,
                                 "aria-label": msg("page.layer_head", { layer: l, head: h }),
                                 "title": msg("page.layer_head", { layer: l, head: h }) });
          var cv = el("canvas", { "width": String(T), "height": String(T) });
          var ctx = cv.getContext("2d"), A = M.attentions[l][h];
          for (var i = 0; i < T; i++) {
            for (var j = 0; j < T; j++) {
              ctx.fillStyle = "rgba(37, 99, 235, " + Math.max(0, Math.min(1, A[i][j])) + ")";
              ctx.fillRect(j, i, 1, 1);
            }
          }
          b.appendChild(cv);
          b.addEventListener("click", function () { sel.layer = l; sel.head = h; show(); });
          thumbs.push(b);
          var td = el("td"); td.appendChild(b); tr.appendChild(td);
        })(l, h);
      }
      grid.appendChild(tr);
    }
    sec.appendChild(grid);
    var heading = el("h3", { "data-testid": "model-selected" });
    sec.appendChild(heading);
    var views = el("div", { "class": "model-views" });
    sec.appendChild(views);

    function show() {
      thumbs.forEach(function (b) { b.setAttribute("aria-pressed", String(b.getAttribute("data-testid") === "thumb-" + sel.layer + "-" + sel.head)); });
      heading.textContent = msg("page.layer_head", { layer: sel.layer, head: sel.head });
      views.textContent = "";
      var A = M.attentions[sel.layer][sel.head];
      // Lines: query tokens on the left, key tokens on the right, opacity = weight.
      var rowH = 22, width = 360, height = T * rowH + 10;
      var svg = svgEl("svg", { "class": "lines", "width": String(width), "height": String(height),
                               "viewBox": "0 0 " + width + " " + height, "data-testid": "model-lines",
                               "role": "img", "aria-label": msg("page.lines_label", { layer: sel.layer, head: sel.head }) });
      for (var i = 0; i < T; i++) {
        for (var j = 0; j < T; j++) {
          var w = A[i][j];
          var line = svgEl("line", { "x1": "110", "y1": String(12 + i * rowH), "x2": String(width - 110), "y2": String(12 + j * rowH),
                                     "stroke-opacity": String(Math.max(0, Math.min(1, w))), "stroke-width": String(0.5 + 3 * w),
                                     "data-testid": "line-" + i + "-" + j, "data-weight": String(w) });
          line.appendChild(svgEl("title", {}, M.tokens[i] + " → " + M.tokens[j] + ": " + num(w)));
          svg.appendChild(line);
        }
      }
      for (i = 0; i < T; i++) {
        svg.appendChild(svgEl("text", { "x": "104", "y": String(16 + i * rowH), "text-anchor": "end", "data-testid": "line-query-" + i }, M.tokens[i]));
        svg.appendChild(svgEl("text", { "x": String(width - 104), "y": String(16 + i * rowH), "data-testid": "line-key-" + i }, M.tokens[i]));
      }
      views.appendChild(svg);
      var saved = DIGITS;
      DIGITS = M.digits || 3;
      views.appendChild(table("attn", msg("page.attn_caption"), msg("page.layer_head", { layer: sel.layer, head: sel.head }), M.tokens, M.tokens, function (i, j, td) {
        numberCell(td, A[i][j], M.tokens[i] + " → " + M.tokens[j] + ": " + num(A[i][j]));
        td.style.backgroundColor = "rgba(37, 99, 235, " + Math.max(0, Math.min(1, A[i][j])) * 0.55 + ")";
      }));
      DIGITS = saved;
    }
    show();
  }

  // ------------------------------------------------------------------ start
  // The template's own words (written in English in template.html) in the page's language.
  function setText(selector, text) { var n = document.querySelector(selector); if (n) n.textContent = text; }
  if (DATA.lang) document.documentElement.setAttribute("lang", DATA.lang);
  setText("header .lead", msg("page.lead"));
  setText("#playground > h2", msg("page.playground"));
  setText("#arith", msg("page.hover"));
  var generator = document.querySelector('meta[name="generator"]');
  setText("footer", msg("page.footer", { version: generator ? generator.getAttribute("content").replace(/^qkv /, "") : "" }));
  if (initial) { resetState(); renderAll(); }
  else { document.getElementById("playground").hidden = true; }
  if (DATA.model) renderModel(DATA.model);
  document.body.setAttribute("data-ready", "true");
})();
