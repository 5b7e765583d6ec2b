/* qkv's offline attention page. The one place where attention is computed outside qkv's Python stages;
   tests/integration/browser/ checks every displayed number against qkv (qkv.attention with a Trace).
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
  // Token text is isolated wherever it sits inside a line of other text (a <bdi>), so that a token holding a
  // right-to-left override (U+202E) or other bidi controls cannot reorder the arithmetic around it. Lines are
  // built as strings with each token between the markers U+E000 and U+E001 (tk); rich() turns them into <bdi>
  // elements, plain() drops them (titles, comparisons).
  var TK_OPEN = "\ue000", TK_CLOSE = "\ue001", TK_STRIP = /[\ue000\ue001]/g;
  function tk(s) { return TK_OPEN + String(s).replace(TK_STRIP, "") + TK_CLOSE; }
  function plain(s) { return String(s).replace(TK_STRIP, ""); }
  function rich(node, text) {
    node.textContent = "";
    String(text).split(TK_OPEN).forEach(function (part, n) {
      if (n === 0) { if (part) node.appendChild(document.createTextNode(part)); return; }
      var close = part.indexOf(TK_CLOSE);
      var token = close < 0 ? part : part.slice(0, close), rest = close < 0 ? "" : part.slice(close + 1);
      node.appendChild(el("bdi", null, token));
      if (rest) node.appendChild(document.createTextNode(rest));
    });
    return node;
  }
  // A localized message whose {token-like} arguments are isolated: msgRich(node, key, {q: tk(token), i: 3}).
  function msgRich(node, key, args) { return rich(node, msg(key, args)); }
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
  // A number in the arithmetic exactly as qkv explain writes it (qkv.explain.doc.fmt, precision 4):
  // rounded to 4 decimals, trailing zeros dropped but one kept (0.39, 1.0), 0, −0.5, tiny ones as 3.2e−5.
  function num(x, p) {
    var s;
    if (p === undefined) p = 4;
    if (Number.isNaN(x)) return "NaN";
    if (!Number.isFinite(x)) return x < 0 ? MINUS + "\u221e" : "\u221e";
    if (x === 0) return "0";
    if (p >= 2 && Math.abs(x) < Number("5e-" + (p + 1))) {
      var parts = x.toExponential(Math.max(p - 2, 1)).split("e"), mant = parts[0];
      if (mant.indexOf(".") >= 0) mant = mant.replace(/0+$/, "").replace(/\.$/, "");
      return (mant + "e" + String(parseInt(parts[1], 10))).replace(/-/g, MINUS);
    }
    s = toFixedEven(x, p);
    if (s.indexOf(".") >= 0) { s = s.replace(/0+$/, ""); if (s.endsWith(".")) s += "0"; }
    if (s === "-0.0" || s === "0.0") s = "0";
    return s.replace(/-/g, MINUS);
  }
  function factor(x, p) { var s = num(x, p); return s.charAt(0) === MINUS ? "(" + s + ")" : s; }

  // ------------------------------------------------------------------ lines that add up (qkv.explain.doc.fit)
  // A written-out line shows its operands with up to 3 decimals more than the 4 asked when that makes it add
  // up: the result of the operands as shown, computed exactly, must lie within half a unit of the result's last
  // shown decimal; else everything at 4 decimals and the relations that do not add up written "≈". Exact
  // decimals: {m: BigInt, e: int} = m·10^e; a quotient stays a fraction {n, d}.
  function dec(text) {
    var s = String(text).trim();
    if (s.charAt(0) === "(" && s.charAt(s.length - 1) === ")") s = s.slice(1, -1);
    s = s.replace(/\u2212/g, "-");
    var mm = /^([+-]?)(\d*)(?:\.(\d*))?(?:e([+-]?\d+))?$/.exec(s);
    if (!mm || (!mm[2] && !mm[3])) return null;
    var frac = mm[3] || "";
    return { m: BigInt((mm[2] || "0") + frac) * (mm[1] === "-" ? -1n : 1n),
             e: (mm[4] ? parseInt(mm[4], 10) : 0) - frac.length };
  }
  function decOf(x) { return typeof x === "number" ? (Number.isFinite(x) ? dec(String(x)) : null) : x; }
  function ten(k) { return 10n ** BigInt(k); }
  function dAdd(a, b) {
    if (!a || !b) return null;
    var e = Math.min(a.e, b.e);
    return { m: a.m * ten(a.e - e) + b.m * ten(b.e - e), e: e };
  }
  function dMul(a, b) { return a && b ? { m: a.m * b.m, e: a.e + b.e } : null; }
  function dNeg(a) { return a ? { m: -a.m, e: a.e } : null; }
  function dDiv(a, b) { return a && b && b.m !== 0n ? { n: a, d: b } : null; }
  function dFloat(a) { return a ? Number(String(a.m) + "e" + a.e) : NaN; }
  function AddUp(q, p, approx) { this.q = q; this.p = p; this.approx = !!approx; this.ok = true; }
  AddUp.prototype.n = function (x) { return num(x, this.q); };
  AddUp.prototype.f = function (x) { return factor(x, this.q); };
  AddUp.prototype.rel = function (exact, value, at) {
    var digits = at === undefined ? this.p : at, text = num(value, digits), v = dec(text), good = false;
    exact = decOf(exact);
    if (exact && v) {
      var unit = { m: 1n, e: Math.min(-digits, v.e) }, lhs, rhs;
      if (exact.n) {                               // |n/d − v| < unit/2  ⇔  2·|n − v·d| < unit·|d|
        lhs = dAdd(exact.n, dNeg(dMul(v, exact.d)));
        rhs = dMul(unit, { m: exact.d.m < 0n ? -exact.d.m : exact.d.m, e: exact.d.e });
      } else {
        lhs = dAdd(exact, dNeg(v));
        rhs = unit;
      }
      lhs = { m: 2n * (lhs.m < 0n ? -lhs.m : lhs.m), e: lhs.e };
      var e = Math.min(lhs.e, rhs.e);
      good = lhs.m * ten(lhs.e - e) < rhs.m * ten(rhs.e - e);
    }
    this.ok = this.ok && good;
    return (this.approx && !good ? "\u2248 " : "= ") + text;
  };
  function fit(build, p) {
    if (p === undefined) p = 4;
    for (var q = p; q <= Math.min(12, p + 3); q++) {
      var ln = new AddUp(q, p), text = build(ln);
      if (ln.ok) return text;
    }
    return build(new AddUp(p, p, true));
  }
  function expPart(x, m, e) {                      // exp(x − m) = e
    if (x === -Infinity) return "exp(" + MINUS + "\u221e) = 0";
    return fit(function (ln) {
      var xt = ln.n(x), mt = ln.f(m), d = dAdd(dec(xt), dNeg(dec(mt)));
      return "exp(" + xt + " " + MINUS + " " + mt + ") " + ln.rel(d ? Math.exp(dFloat(d)) : null, e);
    });
  }
  function ratioPart(e, tot, w) {                  // e / sum = w
    return fit(function (ln) { var et = ln.n(e), tt = ln.n(tot); return et + " / " + tt + " " + ln.rel(dDiv(dec(et), dec(tt)), w); });
  }
  // "lhs = a×b + c×d + … = r", as qkv explain's product lines (more than 8 terms: the first 3 and a count).
  function productLine(lhs, pairs, result) {
    if (pairs.length > 8) {
      return lhs + " = " + pairs.slice(0, 3).map(function (p) { return factor(p[0]) + "\u00d7" + factor(p[1]); }).join(" + ") +
             " + " + msg("page.terms", { n: pairs.length }) + " = " + num(result);
    }
    return fit(function (ln) {
      var exact = { m: 0n, e: 0 };
      var expr = pairs.map(function (p) {
        var a = ln.f(p[0]), b = ln.f(p[1]);
        exact = dAdd(exact, dMul(dec(a), dec(b)));
        return a + "\u00d7" + b;
      }).join(" + ");
      return lhs + " = " + expr + " " + ln.rel(exact, result);
    });
  }
  // qkv explain's softmax lines for query row i, then the one division that gives weights[i][j].
  function softmaxLines(label, keyLabels, x, soft, j) {
    var key = label + "\u0000" + x.join(",");
    if (!soft.lines || soft.linesKey !== key) {
      var C = x.length, show = C <= 8 ? C : 6, parts = [], k, hasSink = soft.sink !== null && soft.sink !== undefined;
      for (k = 0; k < show; k++) parts.push(expPart(x[k], soft.max, soft.exp[k]));
      var lines = [msg("page.row", { label: label }) + ": " + msg("page.max") + " = " + num(soft.max),
                   "  " + parts.join(";  ") + (C > show ? "; \u2026" : "")];
      if (hasSink) lines.push("  " + msg("page.sink") + ": " + expPart(soft.sink, soft.max, soft.sinkExp));
      if (C <= 8) {
        var terms = soft.exp.concat(hasSink ? [soft.sinkExp] : []);
        lines.push("  " + fit(function (ln) {
          var exact = { m: 0n, e: 0 }, shownTerms = terms.map(function (v) { var t = ln.n(v); exact = dAdd(exact, dec(t)); return t; });
          return msg("page.sum") + " = " + shownTerms.join(" + ") + " " + ln.rel(exact, soft.sum);
        }));
      } else {
        lines.push("  " + msg("page.sum") + " = \u03a3 (" + C + ")" + (hasSink ? " + " + num(soft.sinkExp) : "") + " = " + num(soft.sum));
      }
      soft.lines = lines.join("\n");
      soft.linesKey = key;
    }
    return soft.lines + "\n  " + keyLabels[j] + ": " + ratioPart(soft.exp[j], soft.sum, soft.w[j]);
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
    var made = typeof text === "function" ? null : text;
    function get() {
      if (made === null) { made = text(); node.title = plain(made); }
      return made;
    }
    if (made !== null) node.title = plain(made);
    node.addEventListener("mouseenter", function () { rich(arith, get()); });
    node.addEventListener("focus", function () { rich(arith, get()); });
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
    colLabels.forEach(function (c, j) { hr.appendChild(el("th", { "data-testid": name + "-col-" + j }, plain(c))); });
    thead.appendChild(hr);
    t.appendChild(thead);
    var tbody = el("tbody");
    rowLabels.forEach(function (r, i) {
      var tr = el("tr");
      tr.appendChild(el("th", { "scope": "row", "data-testid": name + "-row-" + i }, plain(r)));
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
    var toks = state.tokens.map(tk), ktoks = keyTokens().map(tk), H = state.heads, E = r.E, Ev = r.Ev;
    var xkv = state.X_kv ? "X_kv" : "X";
    function projection(name, src, W, M, width) {
      return table(name, name, name + " = " + (name === "Q" ? "X" : xkv) + " · W_" + name,
                   name === "Q" ? toks : ktoks, indexLabels(M[0].length), function (i, j, td) {
        var pairs = src[i].map(function (x, t) { return [x, W[t][j]]; });
        numberCell(td, M[i][j], function () { return productLine(name + "[" + (name === "Q" ? toks : ktoks)[i] + ", " + j + "]", pairs, M[i][j]); });
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
          numberCell(td, M[i][c], function () {
          var angle = fit(function (ln) {
            var tt = ln.n(th), f = dFloat(dec(num(phi, ln.q)));
            return "\u03c6 = " + pos[i] + " \u00d7 " + tt + " " + ln.rel(dMul({ m: BigInt(pos[i]), e: 0 }, dec(tt)), phi, ln.q) +
                   " rad, cos \u03c6 " + ln.rel(Math.cos(f), co) + ", sin \u03c6 " + ln.rel(Math.sin(f), si);
          });
          var turn = fit(function (ln) {
            var at = ln.f(a), bt = ln.f(b), ct = ln.f(co), st = ln.f(si), A = dec(at), B = dec(bt), Cc = dec(ct), Ss = dec(st);
            var r1 = ln.rel(dAdd(dMul(A, Cc), dNeg(dMul(B, Ss))), M[i][ab[0]]), r2 = ln.rel(dAdd(dMul(B, Cc), dMul(A, Ss)), M[i][ab[1]]);
            var sym = r1.charAt(0) === "\u2248" || r2.charAt(0) === "\u2248" ? "\u2248" : "=";
            return "  = (" + at + "\u00d7" + ct + " " + MINUS + " " + bt + "\u00d7" + st + ", " + bt + "\u00d7" + ct + " + " +
                   at + "\u00d7" + st + ") " + sym + " (" + r1.slice(2) + ", " + r2.slice(2) + ")";
          });
          return hp + name + "[" + labels[i] + ", (" + ab[0] + ", " + ab[1] + ")]: " + angle + "\n" + turn;
          });
        }));
      });
      box.appendChild(rot);
    }
    var attn = el("div", { "class": "matrices" });
    if (state.start !== "scores") {
      attn.appendChild(table("scores", msg("page.cap_scores") + hs, "= Q·Kᵀ", toks, ktoks, function (i, j, td) {
        var pairs = hd.Q[i].map(function (q, t) { return [q, hd.K[j][t]]; });
        numberCell(td, hd.scores[i][j], function () { return hp + productLine("scores[" + toks[i] + ", " + ktoks[j] + "]", pairs, hd.scores[i][j]); });
      }));
    }
    attn.appendChild(table("scaled", msg("page.cap_scaled") + hs, state.scaling ? "= scores ÷ √d_k" : msg("page.scaling_off"), toks, ktoks, function (i, j, td) {
      var s = hd.scores[i][j], v = hd.scaled[i][j];
      var text = function () { return hp + "scaled[" + toks[i] + ", " + ktoks[j] + "] = " + fit(function (ln) {
        var st = ln.n(s);
        if (state.scaling) { var dt = ln.n(Math.sqrt(r.d_k)); return st + " / " + dt + " " + ln.rel(dDiv(dec(st), dec(dt)), v); }
        var ft = ln.n(1.0);
        return st + " \u00d7 " + ft + " " + ln.rel(dMul(dec(st), dec(ft)), v);
      }); };
      if (!r.allowed[i][j]) td.classList.add("masked");     // struck through: −∞ before softmax (see the mask)
      numberCell(td, v, text);
    }));
    if (hd.biased) {
      attn.appendChild(table("biased", msg("page.cap_biased") + hs, "= scaled + m_h\u00b7(j " + MINUS + " i)", toks, ktoks, function (i, j, td) {
        var d = j - i, dist = d < 0 ? "(" + MINUS + (-d) + ")" : String(d);
        numberCell(td, hd.biased[i][j], function () { return hp + "biased[" + toks[i] + ", " + ktoks[j] + "] = " + fit(function (ln) {
          var st = ln.n(hd.scaled[i][j]), mt = ln.f(hd.slope);
          return st + " + " + mt + "\u00d7" + dist + " " + ln.rel(dAdd(dec(st), dMul(dec(mt), { m: BigInt(d), e: 0 })), hd.biased[i][j]);
        }); });
      }));
    }
    if (hd.capped) {
      var c = state.softcap, cc = num(c);
      attn.appendChild(table("capped", msg("page.cap_capped") + hs, msg("page.softcap_formula", { cap: cc }), toks, ktoks, function (i, j, td) {
        var s = (hd.biased || hd.scaled)[i][j], v = hd.capped[i][j];
        numberCell(td, v, function () { return hp + "capped[" + toks[i] + ", " + ktoks[j] + "] = " + fit(function (ln) {
          var ct = ln.n(c), st = ln.n(s), rt = ln.n(s / c), tt = ln.f(v / c);
          var r1 = ln.rel(dDiv(dec(st), dec(ct)), s / c, ln.q), r2 = ln.rel(Math.tanh(dFloat(dec(rt))), v / c, ln.q);
          var r3 = ln.rel(dMul(dec(ct), dec(tt)), v);
          return ct + "\u00b7tanh(" + st + " / " + ct + ") " + r1.charAt(0) + " " + ct + "\u00b7tanh(" + rt + ") " + r2.charAt(0) +
                 " " + ct + "\u00d7" + tt + " " + r3;
        }); });
      }));
    }
    attn.appendChild(table("mask", msg("page.cap_mask"), msg("page.may_attend"), toks, ktoks, function (i, j, td) {
      td.textContent = r.allowed[i][j] ? "1" : "0";
      td.tabIndex = 0;
      explainOn(td, "mask[" + toks[i] + ", " + ktoks[j] + "] = " + (r.allowed[i][j] ? msg("page.mask_yes") : msg("page.mask_no")));
    }));
    var masked = r.allowed.some(function (row) { return row.some(function (ok) { return !ok; }); });
    var last = masked ? "masked" : hd.capped ? "capped" : hd.biased ? "biased" : "scaled";   // as qkv explain names it
    attn.appendChild(table("weights", msg("page.cap_weights") + hs, "= softmax(" + last + ")", toks, ktoks, function (i, j, td) {
      var w = hd.weights[i][j];
      numberCell(td, w, function () {
        var logits = hd.logits[i].map(function (x, k) { return r.allowed[i][k] ? x : -Infinity; });
        return hp + softmaxLines(toks[i], ktoks, logits, hd.soft[i], j);
      });
      td.style.backgroundColor = "rgba(37, 99, 235, " + Math.max(0, Math.min(1, w)) * 0.55 + ")";
    }));
    box.appendChild(attn);

    if (!r.output) return;                  // an example without V stops at the weights
    var outs = el("div", { "class": "matrices" });
    var outCaption = H > 1 ? msg("page.output_concat") : msg("page.cap_output");
    outs.appendChild(table("output", outCaption, H > 1 ? msg("page.output_heads_formula") : "= weights · V", toks,
                           indexLabels(r.output[0].length), function (i, j, td) {
      var h = Math.floor(j / Ev), c = j % Ev, hh = r.heads[h];
      var pairs = hh.weights[i].map(function (w, t) { return [w, hh.V[t][c]]; });
      numberCell(td, r.output[i][j], function () { return (H > 1 ? msg("page.head_prefix", { h: h }) : "") + productLine("output[" + toks[i] + ", " + c + "]", pairs, r.output[i][j]); });
      if (H > 1 && h % 2 === 1) td.classList.add("head-alt");
    }));
    if (r.final) {
      outs.appendChild(table("final_output", msg("page.final_output"), "= output · W_O", toks, indexLabels(r.final[0].length), function (i, j, td) {
        var pairs = r.output[i].map(function (x, t) { return [x, state.W_O[t][j]]; });
        numberCell(td, r.final[i][j], function () { return productLine("final_output[" + toks[i] + ", " + j + "]", pairs, r.final[i][j]); });
      }));
    }
    box.appendChild(outs);
  }

  function updateStatus() {
    var bad = Object.keys(state.invalid).length, status = document.getElementById("status");
    status.textContent = bad === 0 ? "" : msg(bad === 1 ? "page.invalid_one" : "page.invalid_many", { n: bad });
  }
  function update() {
    playgroundTitle().textContent = state.title;
    updateStatus();
    renderResults();
  }
  function renderAll() { renderControls(); renderInputs(); update(); }

  // ------------------------------------------------------------------ maps: attention weights at any size
  // page.py's MapSet: one base64 blob per map (rANS-coded bit lengths in the context (cell above, cell to the
  // left), then the raw bits), one frequency table per group of maps. decodeMap gives the exact integers k of
  // a map (weight = k / 10^digits, the weight qkv computed rounded to those digits); nothing is approximated.
  function b64bytes(s) {
    var bin = atob(s), n = bin.length, out = new Uint8Array(n);
    for (var i = 0; i < n; i++) out[i] = bin.charCodeAt(i);
    return out;
  }
  function decodeMap(blob, t, rows, cols, causal, ns) {
    var u8 = b64bytes(blob);
    var nw = (u8[0] | (u8[1] << 8) | (u8[2] << 16)) + u8[3] * 16777216;
    var w = 4, rawAt = 4 + 2 * nw, bit = 0, f = t.f, cum = t.cum, lut = t.lut;
    var K = new Uint16Array(rows * cols), B = new Uint8Array(rows * cols);
    for (var i = 0; i < rows; i++) {
      var n = causal ? Math.min(cols, i + 1) : cols, base = i * cols;
      var x = (u8[w] | (u8[w + 1] << 8)) * 65536 + (u8[w + 2] | (u8[w + 3] << 8));
      w += 4;
      for (var j = 0; j < n; j++) {
        var c = (i > 0 ? B[base - cols + j] : 0) * ns + (j > 0 ? B[base + j - 1] : 0);
        var slot = x & 4095, s = lut[c * 4096 + slot], fi = c * ns + s;
        x = f[fi] * (x >>> 12) + slot - cum[fi];
        if (x < 65536) { x = x * 65536 + (u8[w] | (u8[w + 1] << 8)); w += 2; }
        var k = s;
        if (s >= 2) {
          var v = 0;
          for (var b = 1; b < s; b++) { v = (v << 1) | ((u8[rawAt + (bit >> 3)] >> (7 - (bit & 7))) & 1); bit++; }
          k = (1 << (s - 1)) + v;
        }
        K[base + j] = k;
        B[base + j] = s;
      }
    }
    return K;
  }
  // The maps of one MapSet, decoded when first shown (the last few kept).
  function MapStore(set) { this.set = set; this.tables = []; this.cache = {}; this.recent = []; }
  MapStore.prototype.count = function () { return this.set.blobs.length; };
  MapStore.prototype.shape = function (m) { return this.set.shapes[m]; };
  MapStore.prototype.causal = function (m) { return !!this.set.causal[m]; };
  MapStore.prototype.table = function (g) {
    if (this.tables[g]) return this.tables[g];
    var ns = this.set.ns, u8 = b64bytes(this.set.tables[g]), n = u8.length >> 1, nctx = n / ns;
    var f = new Uint16Array(n), cum = new Uint16Array(n), lut = new Uint8Array(nctx * 4096);
    for (var i = 0; i < n; i++) f[i] = u8[2 * i] | (u8[2 * i + 1] << 8);
    for (var c = 0; c < nctx; c++) {
      var acc = 0;
      for (var s = 0; s < ns; s++) {
        cum[c * ns + s] = acc;
        lut.fill(s, c * 4096 + acc, c * 4096 + acc + f[c * ns + s]);
        acc += f[c * ns + s];
      }
    }
    return (this.tables[g] = { f: f, cum: cum, lut: lut });
  };
  MapStore.prototype.get = function (m) {
    if (!this.cache[m]) {
      var sh = this.set.shapes[m];
      this.cache[m] = decodeMap(this.set.blobs[m], this.table(this.set.table_of[m]), sh[0], sh[1],
                                !!this.set.causal[m], this.set.ns);
      this.recent.push(m);
      if (this.recent.length > 12) delete this.cache[this.recent.shift()];
    }
    return this.cache[m];
  };
  // k / 10^digits with exactly `digits` decimals ("0.005", "1.000"): the stored integer, written out.
  function kText(k, digits) {
    var s = String(k);
    while (s.length <= digits) s = "0" + s;
    return s.slice(0, s.length - digits) + "." + s.slice(s.length - digits);
  }
  var ACCENT = [37, 99, 235], MASKED = [226, 230, 235];
  function colourTable(top, gamma) {            // 0 … top → white … accent, linear or √ (faint weights)
    var out = new Uint8Array(3 * (top + 1));
    for (var k = 0; k <= top; k++) {
      var t = gamma ? Math.sqrt(k / top) : k / top;
      for (var c = 0; c < 3; c++) out[3 * k + c] = Math.round(255 + t * (ACCENT[c] - 255));
    }
    return out;
  }
  // Line breaks and tabs of a token made visible (↵, ⇥) where it stands among others (chips, labels).
  function visible(s) { return String(s).replace(/\r?\n/g, "\u21b5").replace(/\t/g, "\u21e5"); }
  // A label for the canvas: line breaks and tabs drawn as ↵ and ⇥, a blank token as ␣, long ones cut.
  function shortLabel(s) {
    s = String(s).replace(/\r?\n/g, "\u21b5").replace(/\t/g, "\u21e5");
    if (!s.trim()) s = s.length > 1 ? "\u2423\u00d7" + s.length : "\u2423";
    s = s.replace(/\s+/g, " ");
    return s.length > 12 ? s.slice(0, 11) + "\u2026" : s;
  }

  // A heatmap on <canvas> for one map of any size: hover (or the arrow keys) shows the exact weight of the cell
  // under the pointer; drag a rectangle to zoom into a region, the wheel zooms around the pointer, double-click
  // (or "whole map") shows it all again. Cells smaller than a pixel are max-pooled (said in the hover line).
  function MapView(opts) {
    var self = this, id = opts.testid;
    this.opts = opts;
    this.box = el("div", { "class": "mapview", "data-testid": id });
    var bar = el("div", { "class": "tabs mapbar" });
    function button(key, testid, fn) {
      var b = el("button", { "type": "button", "data-testid": id + "-" + testid }, msg(key));
      b.addEventListener("click", fn);
      bar.appendChild(b);
    }
    button("page.zoom_in", "zoom-in", function () { self.zoom(0.5); });
    button("page.zoom_out", "zoom-out", function () { self.zoom(2); });
    button("page.zoom_reset", "reset", function () { self.reset(); });
    var scale = el("select", { "data-testid": id + "-scale", "aria-label": msg("page.scale_label") });
    scale.appendChild(el("option", { "value": "linear" }, msg("page.scale_linear")));
    scale.appendChild(el("option", { "value": "sqrt" }, msg("page.scale_sqrt")));
    scale.addEventListener("change", function () { self.gamma = scale.value === "sqrt"; self.lut = null; self.draw(); });
    var lab = el("label", null, msg("page.scale_label"));
    lab.appendChild(scale);
    bar.appendChild(lab);
    this.region = el("span", { "class": "note", "data-testid": id + "-region" });
    bar.appendChild(this.region);
    this.box.appendChild(bar);
    var wrap = el("div", { "class": "mapwrap" });
    this.canvas = el("canvas", { "data-testid": id + "-canvas", "tabindex": "0", "role": "img" });
    this.overlay = el("canvas", { "class": "overlay", "aria-hidden": "true" });
    wrap.appendChild(this.canvas);
    wrap.appendChild(this.overlay);
    this.box.appendChild(wrap);
    this.hover = el("p", { "class": "maphover", "data-testid": id + "-hover", "aria-live": "polite" });
    this.box.appendChild(this.hover);
    this.box.appendChild(el("p", { "class": "note" }, msg("page.map_help", { digits: opts.digits })));
    this.off = document.createElement("canvas");
    this.gamma = false;
    this.cursor = null;
    this.drag = null;
    var c = this.canvas;
    c.addEventListener("mousemove", function (e) {
      var cell = self.cellAt(e);
      if (self.drag) { self.drag.to = [e.offsetX, e.offsetY]; self.drawOverlay(); }
      if (cell) { self.cursor = cell; self.showCell(cell[0], cell[1]); if (!self.drag) self.drawOverlay(); }
    });
    c.addEventListener("mousedown", function (e) {
      if (e.button !== 0) return;
      var cell = self.cellAt(e);
      if (cell) self.drag = { from: [e.offsetX, e.offsetY], to: [e.offsetX, e.offsetY], cell: cell };
    });
    c.addEventListener("mouseup", function (e) {
      var d = self.drag;
      self.drag = null;
      if (!d) return;
      var end = self.cellAt(e, true);
      if (Math.abs(e.offsetX - d.from[0]) + Math.abs(e.offsetY - d.from[1]) > 6 && end) {
        self.setView(Math.min(d.cell[0], end[0]), Math.max(d.cell[0], end[0]) + 1,
                     Math.min(d.cell[1], end[1]), Math.max(d.cell[1], end[1]) + 1);
      } else if (end && self.opts.onPick) {
        self.opts.onPick(end[0], end[1]);
      }
      self.drawOverlay();
    });
    c.addEventListener("mouseleave", function () { self.drag = null; self.drawOverlay(); });
    c.addEventListener("dblclick", function () { self.reset(); });
    c.addEventListener("wheel", function (e) {
      var cell = self.cellAt(e);
      if (!cell) return;
      e.preventDefault();
      self.zoom(e.deltaY < 0 ? 0.8 : 1.25, cell);
    }, { passive: false });
    c.addEventListener("keydown", function (e) {
      var cur = self.cursor || [self.view.r0, self.view.c0], i = cur[0], j = cur[1];
      if (e.key === "ArrowUp") i--; else if (e.key === "ArrowDown") i++;
      else if (e.key === "ArrowLeft") j--; else if (e.key === "ArrowRight") j++;
      else if (e.key === "+" || e.key === "=") { self.zoom(0.5, cur); e.preventDefault(); return; }
      else if (e.key === "-") { self.zoom(2, cur); e.preventDefault(); return; }
      else if (e.key === "0") { self.reset(); e.preventDefault(); return; }
      else if ((e.key === "Enter" || e.key === " ") && self.opts.onPick) { self.opts.onPick(i, j); e.preventDefault(); return; }
      else return;
      e.preventDefault();
      i = Math.max(0, Math.min(self.rows - 1, i));
      j = Math.max(0, Math.min(self.cols - 1, j));
      var v = self.view;                      // keep the cursor in view
      if (i < v.r0 || i >= v.r1 || j < v.c0 || j >= v.c1) {
        var R = v.r1 - v.r0, C = v.c1 - v.c0;
        var r0 = i < v.r0 ? i : (i >= v.r1 ? i - R + 1 : v.r0), c0 = j < v.c0 ? j : (j >= v.c1 ? j - C + 1 : v.c0);
        self.setView(r0, r0 + R, c0, c0 + C);
      }
      self.cursor = [i, j];
      self.showCell(i, j);
      self.drawOverlay();
    });
  }
  // K: the decoded map (rows × cols, row-major); rowLabel(i), colLabel(j): the labels; where: e.g. "layer 2, head 5".
  MapView.prototype.show = function (K, rows, cols, causal, rowLabel, colLabel, where) {
    var sameShape = this.K && this.rows === rows && this.cols === cols;
    this.K = K; this.rows = rows; this.cols = cols; this.causal = causal;
    this.rowLabel = rowLabel; this.colLabel = colLabel; this.where = where;
    this.canvas.setAttribute("aria-label", msg("page.heatmap_label", { where: where, rows: rows, cols: cols }));
    if (!sameShape) {
      var W = this.opts.width || 780, PW = W - 110, PH = Math.round(Math.max(140, Math.min(620, PW * rows / cols)));
      if (rows <= 40 && cols <= 40) PH = Math.round(Math.max(60, Math.min(PH, rows * 28)));
      this.PW = PW; this.PH = PH; this.ML = 96; this.MT = 70;
      var cw = this.ML + PW + 10, ch = this.MT + PH + 10, dpr = window.devicePixelRatio || 1;
      [this.canvas, this.overlay].forEach(function (cv) {
        cv.width = Math.round(cw * dpr); cv.height = Math.round(ch * dpr);
        cv.style.width = cw + "px"; cv.style.height = ch + "px";
      });
      this.dpr = dpr;
      this.view = { r0: 0, r1: rows, c0: 0, c1: cols };
      this.cursor = null;
    }
    this.draw();
    var cur = this.cursor || [Math.min(rows - 1, this.opts.startRow || 0), 0];
    this.showCell(cur[0], cur[1]);
  };
  MapView.prototype.stored = function (i) { return this.causal ? Math.min(this.cols, i + 1) : this.cols; };
  MapView.prototype.cellAt = function (e, clamp) {
    var x = e.offsetX - this.ML, y = e.offsetY - this.MT, v = this.view;
    if (!clamp && (x < 0 || y < 0 || x > this.PW || y > this.PH)) return null;   // the edges' pixels count
    x = Math.max(0, Math.min(this.PW - 0.001, x)); y = Math.max(0, Math.min(this.PH - 0.001, y));
    return [v.r0 + Math.floor(y / this.PH * (v.r1 - v.r0)), v.c0 + Math.floor(x / this.PW * (v.c1 - v.c0))];
  };
  MapView.prototype.setView = function (r0, r1, c0, c1) {
    var R = Math.max(1, Math.min(this.rows, r1 - r0)), C = Math.max(1, Math.min(this.cols, c1 - c0));
    r0 = Math.max(0, Math.min(this.rows - R, r0)); c0 = Math.max(0, Math.min(this.cols - C, c0));
    this.view = { r0: r0, r1: r0 + R, c0: c0, c1: c0 + C };
    this.draw();
  };
  MapView.prototype.zoom = function (factor, at) {
    var v = this.view, R = v.r1 - v.r0, C = v.c1 - v.c0;
    var i = at ? at[0] : v.r0 + R / 2, j = at ? at[1] : v.c0 + C / 2;
    var R2 = Math.max(1, Math.round(R * factor)), C2 = Math.max(1, Math.round(C * factor));
    var r0 = Math.round(i - (i - v.r0) * R2 / R), c0 = Math.round(j - (j - v.c0) * C2 / C);
    this.setView(r0, r0 + R2, c0, c0 + C2);
  };
  MapView.prototype.reset = function () { this.setView(0, this.rows, 0, this.cols); };
  MapView.prototype.pooling = function () {
    var v = this.view, d = this.dpr;
    return [Math.max(1, Math.ceil((v.r1 - v.r0) / Math.round(this.PH * d))),
            Math.max(1, Math.ceil((v.c1 - v.c0) / Math.round(this.PW * d)))];
  };
  MapView.prototype.draw = function () {
    var v = this.view, R = v.r1 - v.r0, C = v.c1 - v.c0, K = this.K, cols = this.cols, digits = this.opts.digits;
    var top = Math.pow(10, digits);
    if (!this.lut) this.lut = colourTable(top, this.gamma);
    var lut = this.lut, pool = this.pooling(), fr = pool[0], fc = pool[1];
    var ih = Math.ceil(R / fr), iw = Math.ceil(C / fc), img = new ImageData(iw, ih), px = img.data;
    for (var y = 0; y < ih; y++) {
      var ia = v.r0 + y * fr, ib = Math.min(v.r1, ia + fr);
      for (var x = 0; x < iw; x++) {
        var ja = v.c0 + x * fc, jb = Math.min(v.c1, ja + fc), best = -1;
        for (var i = ia; i < ib; i++) {
          var n = Math.min(jb, this.stored(i)), base = i * cols;
          for (var j = ja; j < n; j++) { var kk = K[base + j]; if (kk > best) best = kk; }
        }
        var p = (y * iw + x) * 4;
        if (best < 0) { px[p] = MASKED[0]; px[p + 1] = MASKED[1]; px[p + 2] = MASKED[2]; }
        else { px[p] = lut[3 * best]; px[p + 1] = lut[3 * best + 1]; px[p + 2] = lut[3 * best + 2]; }
        px[p + 3] = 255;
      }
    }
    this.off.width = iw; this.off.height = ih;
    this.off.getContext("2d").putImageData(img, 0, 0);
    var ctx = this.canvas.getContext("2d"), ML = this.ML, MT = this.MT, PW = this.PW, PH = this.PH;
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.clearRect(0, 0, this.canvas.width, this.canvas.height);
    ctx.setTransform(this.dpr, 0, 0, this.dpr, 0, 0);
    ctx.save();
    ctx.beginPath(); ctx.rect(ML, MT, PW, PH); ctx.clip();
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(this.off, 0, 0, iw, ih, ML, MT, PW * iw * fc / C, PH * ih * fr / R);
    var cw = PW / C, chh = PH / R;
    if (cw >= 10 && chh >= 10) {                  // cell borders, and the numbers where they fit
      ctx.strokeStyle = "rgba(255, 255, 255, 0.9)"; ctx.lineWidth = 1;
      for (var a = 0; a <= R; a++) { ctx.beginPath(); ctx.moveTo(ML, MT + a * chh); ctx.lineTo(ML + PW, MT + a * chh); ctx.stroke(); }
      for (a = 0; a <= C; a++) { ctx.beginPath(); ctx.moveTo(ML + a * cw, MT); ctx.lineTo(ML + a * cw, MT + PH); ctx.stroke(); }
      if (cw >= 36 && chh >= 14) {
        ctx.font = Math.min(13, Math.floor(chh * 0.6)) + "px sans-serif";
        ctx.textAlign = "center"; ctx.textBaseline = "middle";
        for (i = v.r0; i < v.r1; i++) {
          for (j = v.c0; j < Math.min(v.c1, this.stored(i)); j++) {
            var kv = K[i * cols + j];
            ctx.fillStyle = kv > top * 0.55 ? "#ffffff" : "#1f2933";
            ctx.fillText(kText(kv, digits), ML + (j - v.c0 + 0.5) * cw, MT + (i - v.r0 + 0.5) * chh);
          }
        }
      }
    }
    ctx.restore();
    // Labels, thinned to what fits; each drawn by itself (a bidi control in one cannot move another).
    ctx.fillStyle = "#616e7c"; ctx.font = "11px sans-serif";
    ctx.textAlign = "right"; ctx.textBaseline = "middle";
    var step = Math.max(1, Math.ceil(13 / chh));
    for (i = Math.ceil(v.r0 / step) * step; i < v.r1; i += step) {
      ctx.fillText(shortLabel(this.rowLabel(i)), ML - 4, MT + (i - v.r0 + 0.5) * chh, ML - 8);
    }
    step = Math.max(1, Math.ceil(13 / cw));
    ctx.textAlign = "left";
    for (j = Math.ceil(v.c0 / step) * step; j < v.c1; j += step) {
      ctx.save();
      ctx.translate(ML + (j - v.c0 + 0.5) * cw, MT - 4);
      ctx.rotate(-Math.PI / 3);
      ctx.fillText(shortLabel(this.colLabel(j)), 0, 0, 80);
      ctx.restore();
    }
    ctx.strokeStyle = "#cbd2d9"; ctx.strokeRect(ML - 0.5, MT - 0.5, PW + 1, PH + 1);
    this.canvas.setAttribute("data-view", [v.r0, v.r1, v.c0, v.c1].join(" "));
    this.canvas.setAttribute("data-plot", [ML, MT, PW, PH].join(" "));   // where the cells are (CSS px)
    this.canvas.setAttribute("data-pool", fr + " " + fc);
    this.region.textContent = msg("page.map_region", { r0: v.r0, r1: v.r1 - 1, c0: v.c0, c1: v.c1 - 1,
                                                        rows: this.rows, cols: this.cols });
    this.drawOverlay();
  };
  MapView.prototype.drawOverlay = function () {
    var ctx = this.overlay.getContext("2d"), v = this.view;
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.clearRect(0, 0, this.overlay.width, this.overlay.height);
    ctx.setTransform(this.dpr, 0, 0, this.dpr, 0, 0);
    var cw = this.PW / (v.c1 - v.c0), chh = this.PH / (v.r1 - v.r0);
    if (this.drag) {
      var a = this.drag.from, b = this.drag.to;
      ctx.strokeStyle = "#c81e1e"; ctx.lineWidth = 1.5; ctx.setLineDash([4, 3]);
      ctx.strokeRect(Math.min(a[0], b[0]), Math.min(a[1], b[1]), Math.abs(b[0] - a[0]), Math.abs(b[1] - a[1]));
    } else if (this.cursor && this.cursor[0] >= v.r0 && this.cursor[0] < v.r1 && this.cursor[1] >= v.c0 && this.cursor[1] < v.c1) {
      ctx.strokeStyle = "#c81e1e"; ctx.lineWidth = 1.5; ctx.setLineDash([]);
      ctx.strokeRect(this.ML + (this.cursor[1] - v.c0) * cw - 1, this.MT + (this.cursor[0] - v.r0) * chh - 1,
                     Math.max(2, cw) + 2, Math.max(2, chh) + 2);
    }
  };
  // The hover line: which cell, and its weight exactly to the digits shown.
  MapView.prototype.showCell = function (i, j) {
    var stored = j < this.stored(i), k = stored ? this.K[i * this.cols + j] : null, pool = this.pooling();
    var args = { where: this.where, i: i, j: j, q: tk(this.rowLabel(i)), k: tk(this.colLabel(j)),
                 w: stored ? kText(k, this.opts.digits) : "" };
    var text = msg(stored ? (this.opts.hoverKey || "page.map_hover") : "page.map_hover_masked", args);
    if (pool[0] * pool[1] > 1) text += msg("page.map_pooled", { n: pool[0] * pool[1] });
    rich(this.hover, text);
    this.hover.setAttribute("data-i", String(i));
    this.hover.setAttribute("data-j", String(j));
    this.hover.setAttribute("data-w", stored ? kText(k, this.opts.digits) : "");
  };

  // Thumbnails: the max-pooled pictures page.py stored with the maps (uint8, 255 = weight 1).
  function drawThumb(canvas, bytes, offset, shape, lut, top) {
    var tr = shape[0], tc = shape[1];
    canvas.width = tc; canvas.height = tr;
    var img = new ImageData(tc, tr), px = img.data;
    for (var p = 0; p < tr * tc; p++) {
      var k = Math.round(bytes[offset + p] * top / 255);
      px[4 * p] = lut[3 * k]; px[4 * p + 1] = lut[3 * k + 1]; px[4 * p + 2] = lut[3 * k + 2]; px[4 * p + 3] = 255;
    }
    canvas.getContext("2d").putImageData(img, 0, 0);
  }

  // ------------------------------------------------------------------ model view (and a large worked example)
  function renderAtlas(M, sec, kind) {
    sec.hidden = false;
    var store = new MapStore(M.maps), L = M.layers, H = M.heads, T = M.T, digits = M.maps.digits;
    var rowToks = M.tokens, colToks = M.kv_tokens || M.tokens, small = !!M.attentions;
    sec.appendChild(el("h2", null, kind === "example" ? msg("page.example_title", { title: M.name })
                                                      : msg("page.model_title", { name: M.name })));
    if (M.text) {
      sec.appendChild(msgRich(el("p", { "class": "note", "data-testid": "model-text" }), "page.sentence", { text: tk(M.text) }));
    }
    sec.appendChild(el("p", { "class": "note" }, msg(kind === "example" ? "page.example_note"
                                                     : M.source === "qkv.hf" ? (small ? "page.model_note_hf" : "page.model_note_canvas_hf")
                                                     : (small ? "page.model_note" : "page.model_note_canvas"))));
    sec.appendChild(el("p", { "class": "note", "data-testid": kind + "-size" },
                       msg("page.model_size", { tokens: T, layers: L, heads: H, maps: store.count() })));
    if (M.decoder) sec.appendChild(el("p", { "class": "note" }, msg("page.decoder_note", { heads: H, kv: M.kv_heads })));
    var sel = { layer: 0, head: 0 }, thumbs = [], top = Math.pow(10, digits), lut = colourTable(top, false);
    var grid = el("table", { "class": "grid", "data-testid": kind === "example" ? "example-grid" : "model-grid" });
    var hr = el("tr"); hr.appendChild(el("th"));
    for (var h = 0; h < H; h++) hr.appendChild(el("th", null, msg("page.head", { h: h })));
    grid.appendChild(hr);
    var tbytes = M.maps.thumbs ? b64bytes(M.maps.thumbs) : null, toff = 0;
    for (var l = 0; l < L; l++) {
      var tr = el("tr");
      tr.appendChild(el("th", null, kind === "example" ? "" : msg("page.layer", { l: l })));
      for (h = 0; h < H; h++) {
        (function (l, h) {
          var prefix = kind === "example" ? "example-thumb-" : "thumb-";
          var b = el("button", { "type": "button", "class": "thumb", "data-testid": prefix + l + "-" + h,
                                 "aria-label": msg("page.layer_head", { layer: l, head: h }),
                                 "title": msg("page.layer_head", { layer: l, head: h }) });
          var cv = el("canvas");
          var m = l * H + h;
          if (tbytes) { drawThumb(cv, tbytes, toff, M.maps.thumb_shapes[m], lut, top); toff += M.maps.thumb_shapes[m][0] * M.maps.thumb_shapes[m][1]; }
          b.appendChild(cv);
          if (M.head_kinds) kindLabel(b, l, h);
          b.addEventListener("click", function () { sel.layer = l; sel.head = h; show(); });
          thumbs.push(b);
          var td = el("td"); td.appendChild(b); tr.appendChild(td);
        })(l, h);
      }
      grid.appendChild(tr);
    }
    sec.appendChild(grid);
    if (M.head_kinds) {
      var legend = KIND_ORDER.map(function (k) { return KIND_LETTERS[k] + " " + msg(KIND_KEYS[k]); }).join(" \u00b7 ");
      sec.appendChild(el("p", { "class": "note", "data-testid": "kinds-note" },
                         msg("page.kinds_note", { legend: legend, pattern: M.head_kinds.pattern_min, broad: M.head_kinds.broad_min })));
    }
    var heading = el("h3", { "data-testid": kind === "example" ? "example-selected" : "model-selected" });
    sec.appendChild(heading);
    var view = new MapView({ testid: kind === "example" ? "example-map" : "model-map", digits: digits });
    sec.appendChild(view.box);
    var views = el("div", { "class": "model-views" });
    sec.appendChild(views);

    // Heads at a glance (qkv.viz.head_kinds): the pattern's letter and its score in percent under each thumbnail.
    function kindLabel(b, l, h) {
      var hk = M.head_kinds, k = hk.kind[l][h], sc = hk.scores[l], shownKind = k, lower = false;
      if (k === "mixed") {
        shownKind = KIND_ORDER.slice(0, 5).reduce(function (a, c) { return sc[c][h] > sc[a][h] ? c : a; }, "previous");
        lower = true;
      }
      var score = sc[shownKind][h], letter = KIND_LETTERS[shownKind];
      b.appendChild(el("span", { "class": "kind" }, (lower ? letter.toLowerCase() : letter) + Math.min(99, Math.round(100 * score))));
      b.setAttribute("data-kind", k);
      b.setAttribute("data-score", String(score));
      b.title = msg("page.kind_title", { layer: l, head: h, kind: msg(KIND_KEYS[k]), score: num(score, 2) });
    }
    function show() {
      var m = sel.layer * H + sel.head, where = msg("page.layer_head", { layer: sel.layer, head: sel.head });
      thumbs.forEach(function (b, n) { b.setAttribute("aria-pressed", String(n === m)); });
      heading.textContent = where;
      var K = store.get(m), sh = store.shape(m), causal = store.causal(m);
      view.show(K, sh[0], sh[1], causal, function (i) { return rowToks[i]; }, function (j) { return colToks[j]; }, where);
      views.textContent = "";
      if (small) smallViews(K, sh[0], sh[1], causal, M.attentions[sel.layer][sel.head], where);
    }
    // Small texts: lines between the tokens (opacity and width = weight) and the table of numbers.
    function smallViews(K, R, C, causal, A, where) {
      var rowH = 22, width = 360, height = Math.max(R, C) * rowH + 10;
      var svg = svgEl("svg", { "class": "lines", "width": String(width), "height": String(height),
                               "viewBox": "0 0 " + width + " " + height, "data-testid": "model-lines",
                               "role": "img", "aria-label": msg("page.lines_label", { layer: sel.layer, head: sel.head }) });
      for (var i = 0; i < R; i++) {
        for (var j = 0; j < C; j++) {
          var w = A[i][j];
          var line = svgEl("line", { "x1": "110", "y1": String(12 + i * rowH), "x2": String(width - 110), "y2": String(12 + j * rowH),
                                     "stroke-opacity": String(Math.max(0, Math.min(1, w))), "stroke-width": String(0.5 + 3 * w),
                                     "data-testid": "line-" + i + "-" + j, "data-weight": String(w) });
          line.appendChild(svgEl("title", {}, rowToks[i] + " \u2192 " + colToks[j] + ": " +
                                 (j < (causal ? Math.min(C, i + 1) : C) ? kText(K[i * C + j], digits) : "0")));
          svg.appendChild(line);
        }
      }
      for (i = 0; i < R; i++) svg.appendChild(svgEl("text", { "x": "104", "y": String(16 + i * rowH), "text-anchor": "end", "data-testid": "line-query-" + i }, rowToks[i]));
      for (j = 0; j < C; j++) svg.appendChild(svgEl("text", { "x": String(width - 104), "y": String(16 + j * rowH), "data-testid": "line-key-" + j }, colToks[j]));
      views.appendChild(svg);
      views.appendChild(table("attn", msg("page.attn_caption"), where, rowToks.map(tk), colToks.map(tk), function (i, j, td) {
        var stored = j < (causal ? Math.min(C, i + 1) : C), k = stored ? K[i * C + j] : 0;
        td.textContent = kText(k, digits);
        td.tabIndex = 0;
        explainOn(td, tk(rowToks[i]) + " \u2192 " + tk(colToks[j]) + ": " + kText(k, digits));
        td.style.backgroundColor = "rgba(37, 99, 235, " + (k / top) * 0.55 + ")";
      }));
    }
    show();
    // Attention rollout (qkv.viz.rollout) and, beside it, attention flow (qkv.viz.attention_flow, networkx
    // max-flow): one map each, computed in Python; flow only up to the size page.py computes it for.
    if (M.rollout) {
      var pair = el("div", { "class": M.flow ? "model-views pair" : "model-views" }), width = M.flow ? 560 : undefined;
      sec.appendChild(pair);
      oneMap(pair, M.rollout, "rollout", "page.rollout_title", "page.rollout_note", "page.rollout_where", width);
      if (M.flow) oneMap(pair, M.flow, "flow", "page.flow_title", "page.flow_note", "page.flow_where", width);
    }
    if (M.flow_limit) {
      var fl = M.flow_limit;
      sec.appendChild(el("p", { "class": "note", "data-testid": "flow-missing" },
                         msg(fl.reason === "networkx" ? "page.flow_missing" : "page.flow_too_big",
                             { limit: fl.limit, layers: fl.layers, tokens: T })));
    }
    function oneMap(parent, set, name, titleKey, noteKey, whereKey, width) {
      var col = el("div", { "data-testid": name + "-view" });
      parent.appendChild(col);
      col.appendChild(el("h3", { "data-testid": name + "-title" }, msg(titleKey)));
      col.appendChild(el("p", { "class": "note" }, msg(noteKey, { layers: L })));
      var st = new MapStore(set), mv = new MapView({ testid: name + "-map", digits: set.digits, width: width });
      col.appendChild(mv.box);
      var sh = st.shape(0);
      mv.show(st.get(0), sh[0], sh[1], st.causal(0), function (i) { return rowToks[i]; },
              function (j) { return colToks[j]; }, msg(whereKey));
    }
  }
  var KIND_ORDER = ["previous", "next", "same", "sink", "long_range", "broad"];
  var KIND_LETTERS = { previous: "P", next: "N", same: "D", sink: "S", long_range: "L", broad: "B", mixed: "\u00b7" };
  var KIND_KEYS = { previous: "page.kind_previous", next: "page.kind_next", same: "page.kind_same", sink: "page.kind_sink",
                    long_range: "page.kind_long_range", broad: "page.kind_broad", mixed: "page.kind_mixed" };

  // ------------------------------------------------------------------ generation view
  // Step through the generated tokens; for each, its attention over the earlier tokens in every layer and head
  // (the map's rows), exact on hover; pick a row to colour the tokens by that layer and head.
  function renderGeneration(G) {
    var sec = document.getElementById("generation");
    sec.hidden = false;
    var store = new MapStore(G.steps), L = G.layers, H = G.heads, P = G.prompt_len, N = store.count();
    var toks = G.tokens, digits = G.steps.digits, top = Math.pow(10, digits);
    sec.appendChild(el("h2", null, msg("page.gen_title", { name: G.name })));
    sec.appendChild(msgRich(el("p", { "class": "note", "data-testid": "gen-prompt" }), "page.gen_prompt", { text: tk(G.prompt) }));
    sec.appendChild(msgRich(el("p", { "class": "note", "data-testid": "gen-text" }),
                            G.finish === "eos" ? "page.gen_text_eos" : "page.gen_text_length", { text: tk(G.text), n: N }));
    sec.appendChild(el("p", { "class": "note" }, msg(G.source === "qkv.hf" ? "page.gen_note_hf" : "page.gen_note", { n: N, p: P })));
    var bar = el("div", { "class": "tabs" });
    var prev = el("button", { "type": "button", "data-testid": "gen-prev" }, msg("page.gen_prev"));
    var range = el("input", { "type": "range", "min": "0", "max": String(N - 1), "value": "0", "data-testid": "gen-step",
                              "aria-label": msg("page.gen_step_label") });
    var next = el("button", { "type": "button", "data-testid": "gen-next" }, msg("page.gen_next"));
    var label = el("span", { "data-testid": "gen-label" });
    [prev, range, next, label].forEach(function (n) { bar.appendChild(n); });
    sec.appendChild(bar);
    var line = el("p", { "class": "gen-tokens", "data-testid": "gen-tokens" });
    var chips = toks.map(function (t, j) {
      var c = el("bdi", { "class": "chip" + (j >= P ? " gen" : ""), "data-testid": "gen-tok-" + j }, visible(t));
      line.appendChild(c);
      return c;
    });
    sec.appendChild(line);
    var selected = el("p", { "class": "note", "data-testid": "gen-selected" });
    sec.appendChild(selected);
    var state = { step: 0, row: 0 };
    var view = new MapView({ testid: "gen-map", digits: digits, hoverKey: "page.gen_hover",
                             onPick: function (i) { state.row = i; colour(); } });
    sec.appendChild(view.box);
    function rowLabel(i) { return msg("page.layer_head_short", { layer: Math.floor(i / H), head: i % H }); }
    function colour() {
      var K = store.get(state.step), C = P + state.step + 1, where = msg("page.layer_head", { layer: Math.floor(state.row / H), head: state.row % H });
      selected.textContent = msg("page.gen_selected", { where: where });
      chips.forEach(function (c, j) {
        c.classList.toggle("current", j === C - 1);
        c.classList.toggle("future", j >= C);
        if (j < C) {
          var k = K[state.row * C + j];
          c.style.backgroundColor = "rgba(37, 99, 235, " + (0.08 + 0.8 * k / top) + ")";
          c.title = msg("page.gen_chip", { where: where, w: kText(k, digits) });
          c.setAttribute("data-w", kText(k, digits));
        } else {
          c.style.backgroundColor = "";
          c.title = "";
          c.removeAttribute("data-w");
        }
      });
    }
    function go(s) {
      state.step = Math.max(0, Math.min(N - 1, s));
      range.value = String(state.step);
      var C = P + state.step + 1;
      label.textContent = "";
      msgRich(label, "page.gen_step", { s: state.step + 1, n: N, token: tk(visible(toks[C - 1])) });
      view.show(store.get(state.step), L * H, C, false, rowLabel, function (j) { return toks[j]; },
                msg("page.gen_where", { s: state.step + 1 }));
      colour();
    }
    prev.addEventListener("click", function () { go(state.step - 1); });
    next.addEventListener("click", function () { go(state.step + 1); });
    range.addEventListener("input", function () { go(Number(range.value)); });
    go(0);
  }

  // ------------------------------------------------------------------ compare view (qkv.hf.compare)
  // Two checkpoints of one architecture on the same text: the heads ranked by the Jensen–Shannon divergence (bits)
  // of their rows, computed in Python (page_hf.compare_data); a row of the table shows that head's weights in
  // both models side by side (A | B), exact on hover. Map k is pair k of model A, map n + k the same of model B.
  function renderCompare(C) {
    var sec = document.getElementById("compare");
    sec.hidden = false;
    var store = new MapStore(C.maps), n = C.pairs.length, digits = C.maps.digits, toks = C.tokens;
    sec.appendChild(el("h2", null, msg("page.cmp_title", { a: C.name, b: C.name_b })));
    sec.appendChild(msgRich(el("p", { "class": "note", "data-testid": "cmp-text" }), "page.sentence", { text: tk(C.text) }));
    sec.appendChild(el("p", { "class": "note" }, msg("page.cmp_note", { tokens: C.T })));
    var selected = el("p", { "class": "note", "data-testid": "cmp-selected" });
    var table = el("table", { "class": "matrix cmp-table", "data-testid": "cmp-table" });
    table.appendChild(el("caption", null, msg("page.cmp_table")));
    var hr = el("tr");
    ["page.cmp_rank", "page.cmp_layer", "page.cmp_head", "page.cmp_mean", "page.cmp_max"].forEach(function (k) {
      hr.appendChild(el("th", { "scope": "col" }, msg(k)));
    });
    table.appendChild(el("thead")).appendChild(hr);
    var body = el("tbody"), rows = [];
    C.table.forEach(function (r, k) {
      var tr = el("tr", { "data-testid": "cmp-row-" + k, "data-layer": String(r[0]), "data-head": String(r[1]),
                          "data-js-mean": String(r[2]), "data-js-max": String(r[3]), "tabindex": "0",
                          "aria-pressed": "false" });
      tr.appendChild(el("th", { "scope": "row" }, String(k + 1)));
      [String(r[0]), String(r[1]), r[2].toFixed(6), r[3].toFixed(6)].forEach(function (t, c) {
        tr.appendChild(el("td", { "data-testid": "cmp-" + k + "-" + c }, t));
      });
      tr.addEventListener("click", function () { select(k); });
      tr.addEventListener("keydown", function (e) {
        if (e.key === "Enter" || e.key === " ") { select(k); e.preventDefault(); }
      });
      rows.push(tr);
      body.appendChild(tr);
    });
    table.appendChild(body);
    var box = el("div", { "class": "cmp-scroll" });
    box.appendChild(table);
    sec.appendChild(box);
    sec.appendChild(selected);
    var pair = el("div", { "class": "model-views pair" }), left = el("div"), right = el("div");
    pair.appendChild(left); pair.appendChild(right);
    sec.appendChild(pair);
    var views = [[left, "cmp-map-a", C.name], [right, "cmp-map-b", C.name_b]].map(function (v) {
      v[0].appendChild(el("h3", { "data-testid": v[1] + "-title" }, v[2]));
      var mv = new MapView({ testid: v[1], digits: digits, width: 560 });
      v[0].appendChild(mv.box);
      return mv;
    });
    function select(k) {
      var r = C.table[k], m = -1;
      C.pairs.forEach(function (p, i) { if (p[0] === r[0] && p[1] === r[1]) m = i; });
      rows.forEach(function (tr, i) { tr.setAttribute("aria-pressed", String(i === k)); });
      selected.textContent = msg("page.cmp_selected", { layer: r[0], head: r[1], mean: r[2].toFixed(6), max: r[3].toFixed(6) });
      selected.setAttribute("data-pair", String(m));
      [m, n + m].forEach(function (map, side) {
        var sh = store.shape(map), name = side ? C.name_b : C.name;
        views[side].show(store.get(map), sh[0], sh[1], store.causal(map), function (i) { return toks[i]; },
                         function (j) { return toks[j]; }, msg("page.cmp_where", { name: name, layer: r[0], head: r[1] }));
      });
    }
    select(0);
  }

  // ------------------------------------------------------------------ the page opens on what was asked
  // With DATA.first (qkv view --hf, --text, --generate, --compare) the page's title (the tab's, set in Python:
  // the model and the input) is the top heading, the view asked for comes first, then the other model views,
  // and the playground and "Why ÷ √d_k" are folded at the end (a <details>, one click away).
  var FOLDED = !!DATA.first;
  function playgroundTitle() {
    return document.getElementById(FOLDED ? "playground-title" : "title");
  }
  function foldPage() {
    var notices = document.getElementById("notices"), after = notices;
    document.getElementById("title").textContent = document.title;
    [DATA.first].concat(["compare", "generation", "model", "example"]).forEach(function (id, n, all) {
      var s = document.getElementById(id);
      if (all.indexOf(id) !== n || !s) return;
      after.after(s);
      after = s;
    });
    var what = [];
    if (DATA.playground) what.push(msg("page.playground") + " \u2014 " + DATA.playground.title);
    if (DATA.why) what.push(msg("page.why_title"));
    var pg = document.getElementById("playground"), why = document.getElementById("why");
    if (!what.length) return;
    var more = el("details", { "id": "more", "data-testid": "more" });
    more.appendChild(el("summary", { "data-testid": "more-summary" }, msg("page.more", { what: what.join(" \u00b7 ") })));
    document.querySelector("main").appendChild(more);
    more.appendChild(document.querySelector("header .lead"));     // it describes the playground
    more.appendChild(pg);
    more.appendChild(why);
    var h = el("h3", { "id": "playground-title", "data-testid": "playground-title" });
    pg.insertBefore(h, pg.children[1] || null);
  }

  // ------------------------------------------------------------------ long-input view (issue 41)
  // qkv view --hf DIR --text-file FILE (qkv.viz.page_long): a text of up to 32,768 tokens. Everything here was
  // computed in Python without the N² weights: each head's summary streamed over blocks of query rows (entropy,
  // mean distance, sink share, kind), its map max-pooled to at most 256 × 256 cells (a cell: the largest weight of
  // its block of queries and keys) and the query rows asked for (--rows) exactly. Map m = layer · H + head.
  function renderLong(D) {
    var sec = document.getElementById("long");
    sec.hidden = false;
    sec.setAttribute("aria-label", msg("page.section_long"));
    var L = D.layers, H = D.heads, T = D.T, S = D.summary, toks = D.tokens, digits = D.pooled.digits;
    var re = D.row_edges, ce = D.col_edges, sd = S.digits, pooled = new MapStore(D.pooled);
    var exact = D.exact ? new MapStore(D.exact) : null, sel = { layer: 0, head: 0 }, marks = [];
    sec.appendChild(el("h2", null, msg("page.long_title", { name: D.name, tokens: T })));
    sec.appendChild(el("p", { "class": "note", "data-testid": "long-note" },
                       msg("page.long_note", { tokens: T, rows: re.length - 1, cols: ce.length - 1 })));
    var top = Math.pow(10, digits), lut = colourTable(top, false);
    var grid = el("table", { "class": "grid", "data-testid": "long-grid" }), hr = el("tr");
    hr.appendChild(el("th"));
    for (var h = 0; h < H; h++) hr.appendChild(el("th", null, msg("page.head", { h: h })));
    grid.appendChild(hr);
    var tbytes = D.pooled.thumbs ? b64bytes(D.pooled.thumbs) : null, toff = 0;
    for (var l = 0; l < L; l++) {
      var tr = el("tr");
      tr.appendChild(el("th", null, msg("page.layer", { l: l })));
      for (h = 0; h < H; h++) {
        var b = el("button", { "type": "button", "class": "thumb", "data-testid": "long-thumb-" + l + "-" + h,
                               "aria-label": msg("page.layer_head", { layer: l, head: h }) }), cv = el("canvas"), m = l * H + h;
        if (tbytes) { drawThumb(cv, tbytes, toff, D.pooled.thumb_shapes[m], lut, top); toff += D.pooled.thumb_shapes[m][0] * D.pooled.thumb_shapes[m][1]; }
        b.appendChild(cv);
        b.appendChild(el("span", { "class": "kind" }, kindShort(l, h)));
        b.setAttribute("data-kind", S.kind[l][h]);
        b.addEventListener("click", pick(l, h));
        marks.push(b);
        var td = el("td"); td.appendChild(b); tr.appendChild(td);
      }
      grid.appendChild(tr);
    }
    sec.appendChild(grid);
    var legend = KIND_ORDER.map(function (k) { return KIND_LETTERS[k] + " " + msg(KIND_KEYS[k]); }).join(" \u00b7 ");
    sec.appendChild(el("p", { "class": "note" }, msg("page.kinds_note", { legend: legend, pattern: S.pattern_min, broad: S.broad_min })));
    // The summaries, one row per head.
    var table = el("table", { "class": "matrix long-table", "data-testid": "long-table" });
    table.appendChild(el("caption", null, msg("page.long_table")));
    var head = el("tr");
    ["page.long_layer", "page.long_head", "page.long_kind", "page.long_entropy", "page.long_distance", "page.long_sink"].forEach(function (k) {
      head.appendChild(el("th", { "scope": "col" }, msg(k)));
    });
    table.appendChild(el("thead")).appendChild(head);
    var body = el("tbody");
    for (l = 0; l < L; l++) {
      for (h = 0; h < H; h++) {
        var row = el("tr", { "data-testid": "long-row-" + l + "-" + h, "tabindex": "0" });
        row.appendChild(el("td", null, String(l)));
        row.appendChild(el("td", null, String(h)));
        row.appendChild(el("td", { "data-testid": "long-" + l + "-" + h + "-kind", "data-kind": S.kind[l][h] }, msg(KIND_KEYS[S.kind[l][h]])));
        [["entropy", S.entropy], ["distance", S.distance], ["sink", S.sink]].forEach(function (f) {
          row.appendChild(el("td", { "data-testid": "long-" + l + "-" + h + "-" + f[0] }, f[1][l][h].toFixed(sd)));
        });
        row.addEventListener("click", pick(l, h));
        row.addEventListener("keydown", (function (go) {
          return function (e) { if (e.key === "Enter" || e.key === " ") { go(); e.preventDefault(); } };
        })(pick(l, h)));
        marks.push(row);
        body.appendChild(row);
      }
    }
    table.appendChild(body);
    var scroll = el("div", { "class": "long-scroll" });
    scroll.appendChild(table);
    sec.appendChild(scroll);
    var heading = el("h3", { "data-testid": "long-selected" });
    sec.appendChild(heading);
    var view = new MapView({ testid: "long-map", digits: digits, hoverKey: "page.long_hover" });
    sec.appendChild(view.box);
    var rowsBox = el("div", { "data-testid": "long-rows-box" }), rowsView = null, topBox = el("div", { "data-testid": "long-top" });
    sec.appendChild(el("h3", null, msg("page.long_rows_title")));
    if (exact) {
      sec.appendChild(el("p", { "class": "note" }, msg("page.long_rows_note", { digits: digits, rows: D.rows.join(", ") })));
      rowsView = new MapView({ testid: "long-rows", digits: digits });
      rowsBox.appendChild(rowsView.box);
      rowsBox.appendChild(topBox);
    } else {
      rowsBox.appendChild(el("p", { "class": "note", "data-testid": "long-no-rows" }, msg("page.long_no_rows")));
    }
    sec.appendChild(rowsBox);
    function kindShort(l, h) {
      var k = S.kind[l][h], sc = S.scores[l], shownKind = k;
      if (k === "mixed") shownKind = KIND_ORDER.slice(0, 5).reduce(function (a, c) { return sc[c][h] > sc[a][h] ? c : a; }, "previous");
      var letter = KIND_LETTERS[shownKind];
      return (k === "mixed" ? letter.toLowerCase() : letter) + Math.min(99, Math.round(100 * sc[shownKind][h]));
    }
    function span(edges, i) {                     // the tokens a pooled row or column covers
      var a = edges[i], b = edges[i + 1] - 1;
      return a === b ? a + " " + toks[a] : a + "\u2013" + b;
    }
    function pick(l, h) { return function () { sel.layer = l; sel.head = h; show(); }; }
    function show() {
      var m = sel.layer * H + sel.head, where = msg("page.layer_head", { layer: sel.layer, head: sel.head });
      marks.forEach(function (b) {
        var id = b.getAttribute("data-testid"), mine = /-(\d+)-(\d+)$/.exec(id);
        b.setAttribute("aria-pressed", String(+mine[1] === sel.layer && +mine[2] === sel.head));
      });
      heading.textContent = msg("page.long_where", { where: where });
      var sh = pooled.shape(m);
      view.show(pooled.get(m), sh[0], sh[1], pooled.causal(m), function (i) { return span(re, i); },
                function (j) { return span(ce, j); }, where);
      if (!rowsView) return;
      var K = exact.get(m), es = exact.shape(m), R = es[0], C = es[1];
      rowsView.show(K, R, C, false, function (r) { return "#" + D.rows[r] + " " + toks[D.rows[r]]; },
                    function (j) { return toks[j]; }, where);
      topBox.textContent = "";
      for (var r = 0; r < R; r++) {                // each row's strongest keys, from the exact weights
        var best = [];
        for (var j = 0; j < C; j++) {
          var k = K[r * C + j];
          if (best.length < 5 || k > best[best.length - 1][0]) {
            best.push([k, j]);
            best.sort(function (x, y) { return y[0] - x[0] || x[1] - y[1]; });
            if (best.length > 5) best.pop();
          }
        }
        var line = best.map(function (x) { return tk(visible(toks[x[1]])) + "#" + x[1] + " " + kText(x[0], digits); }).join("  ");
        var p = msgRich(el("p", { "class": "note", "data-testid": "long-top-" + r }), "page.long_top",
                        { row: D.rows[r], q: tk(visible(toks[D.rows[r]])), keys: line });
        p.setAttribute("data-keys", best.map(function (x) { return x[1] + ":" + kText(x[0], digits); }).join(" "));
        topBox.appendChild(p);
      }
    }
    show();
  }

  // ------------------------------------------------------------------ why ÷ √d_k
  // qkv.lab.scale's rows and one sampled query row per d_k, all computed in Python (page.py why_data); a slider
  // picks the d_k whose numbers are shown, the bars and the curves only draw them.
  var WHY_UNSCALED = "#2563eb", WHY_SCALED = "#f59e0b";
  var WHY_METRICS = [["score_var", "lab.col_var"], ["max_weight", "lab.col_max_weight"], ["entropy", "lab.col_entropy"],
                     ["grad_norm", "lab.col_grad"]];
  function hidpi(canvas, w, h) {
    var dpr = window.devicePixelRatio || 1;
    canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr);
    canvas.style.width = w + "px"; canvas.style.height = h + "px";
    var ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    return ctx;
  }
  function renderWhy(W) {
    var sec = document.getElementById("why");
    sec.hidden = false;
    Object.keys(W.strings || {}).forEach(function (k) { STRINGS[k] = W.strings[k]; });   // the lab's own labels
    sec.setAttribute("aria-label", msg("page.why_title"));
    var rows = W.scale.rows, examples = W.examples, keys = W.scale.settings.keys, theory = W.scale.theory;
    sec.appendChild(el("h2", null, msg("page.why_title")));
    sec.appendChild(el("p", { "class": "note", "data-testid": "why-paragraph" }, W.paragraph));
    sec.appendChild(el("p", { "class": "note", "data-testid": "why-source" },
                       msg("page.why_source", { seed: W.seed, samples: W.samples, keys: keys })));
    var start = 0;
    rows.forEach(function (r, n) { if (r.d_k <= 64) start = n; });
    var bar = el("div", { "class": "controls" });
    var lab = el("label", null, "d_k");
    var range = el("input", { "type": "range", "min": "0", "max": String(rows.length - 1), "step": "1",
                              "value": String(start), "data-testid": "why-dk", "aria-label": msg("page.why_slider") });
    lab.appendChild(range);
    bar.appendChild(lab);
    var shown = el("output", { "data-testid": "why-dk-value" });
    bar.appendChild(shown);
    sec.appendChild(bar);
    var table = el("table", { "class": "matrix", "data-testid": "why-table" });
    var hr = el("tr");
    [msg("page.why_metric"), msg("lab.unscaled"), msg("lab.scaled")].forEach(function (t) { hr.appendChild(el("th", null, t)); });
    table.appendChild(el("thead")).appendChild(hr);
    var body = el("tbody"), cells = {};
    WHY_METRICS.forEach(function (m) {
      var tr = el("tr");
      tr.appendChild(el("th", { "scope": "row" }, msg(m[1])));
      [m[0], m[0] + "_scaled"].forEach(function (key) {
        cells[key] = el("td", { "data-testid": "why-" + key });
        tr.appendChild(cells[key]);
      });
      body.appendChild(tr);
    });
    table.appendChild(body);
    var views = el("div", { "class": "model-views pair" });
    var left = el("div"), right = el("div");
    views.appendChild(left); views.appendChild(right);
    sec.appendChild(views);
    left.appendChild(table);
    var theoryLine = el("p", { "class": "note", "data-testid": "why-theory" });
    left.appendChild(theoryLine);
    var curvesTitle = el("p", { "class": "note" }, msg("page.why_curves_title"));
    left.appendChild(curvesTitle);
    var curves = el("canvas", { "data-testid": "why-curves", "role": "img", "aria-label": msg("page.why_curves_title") });
    left.appendChild(curves);
    var barsTitle = el("p", { "class": "note", "data-testid": "why-bars-title" });
    right.appendChild(barsTitle);
    var bars = el("canvas", { "data-testid": "why-bars", "tabindex": "0", "role": "img" });
    right.appendChild(bars);
    var hover = el("p", { "class": "maphover", "data-testid": "why-bars-hover", "aria-live": "polite" });
    right.appendChild(hover);
    right.appendChild(el("p", { "class": "note" }, msg("page.why_bars_help")));
    var state = { n: start, j: 0 };
    var BW = 520, BH = 230, BL = 80, BT = 10, PANEL = 95, GAP = 14;

    function drawBars() {
      var ex = examples[state.n], ctx = hidpi(bars, BW, BH), bw = (BW - BL - 10) / keys;
      [["weights", WHY_UNSCALED, "lab.unscaled"], ["weights_scaled", WHY_SCALED, "lab.scaled"]].forEach(function (p, k) {
        var top = BT + k * (PANEL + GAP);
        ctx.strokeStyle = "#cbd2d9"; ctx.strokeRect(BL - 0.5, top - 0.5, keys * bw + 1, PANEL + 1);
        ctx.fillStyle = "#616e7c"; ctx.font = "11px sans-serif"; ctx.textAlign = "right"; ctx.textBaseline = "middle";
        ctx.fillText(msg(p[2]), BL - 6, top + PANEL / 2, BL - 8);
        ctx.fillText("1", BL - 6, top + 4); ctx.fillText("0", BL - 6, top + PANEL - 4);
        ctx.fillStyle = p[1];
        ex[p[0]].forEach(function (w, j) {
          var h = Math.max(0, Math.min(1, w)) * PANEL;
          ctx.fillRect(BL + j * bw + 1, top + PANEL - h, Math.max(1, bw - 2), h);
        });
      });
      ctx.fillStyle = "#616e7c"; ctx.textAlign = "center"; ctx.textBaseline = "top";
      for (var j = 0; j < keys; j++) ctx.fillText(String(j), BL + (j + 0.5) * bw, BT + 2 * PANEL + GAP + 4);
      var j0 = state.j;
      ctx.strokeStyle = "#c81e1e"; ctx.lineWidth = 1.5;
      ctx.strokeRect(BL + j0 * bw, BT - 2, bw, 2 * PANEL + GAP + 4);
      bars.setAttribute("data-plot", [BL, BT, keys * bw, 2 * PANEL + GAP].join(" "));
    }
    function showBar(j) {
      var ex = examples[state.n];
      state.j = Math.max(0, Math.min(keys - 1, j));
      j = state.j;
      hover.textContent = msg("page.why_bars_hover", { j: j, s: num(ex.scores[j]), w: num(ex.weights[j]),
                                                       ss: num(ex.scaled[j]), ws: num(ex.weights_scaled[j]) });
      hover.setAttribute("data-j", String(j));
      hover.setAttribute("data-w", String(ex.weights[j]));
      hover.setAttribute("data-ws", String(ex.weights_scaled[j]));
      drawBars();
    }
    bars.addEventListener("mousemove", function (e) {
      var bw = (BW - BL - 10) / keys, x = e.offsetX - BL;
      if (x >= 0 && x < keys * bw) showBar(Math.floor(x / bw));
    });
    bars.addEventListener("keydown", function (e) {
      if (e.key === "ArrowLeft") showBar(state.j - 1); else if (e.key === "ArrowRight") showBar(state.j + 1); else return;
      e.preventDefault();
    });

    var CW = 520, CH = 200;
    function drawCurves() {
      var ctx = hidpi(curves, CW, CH), lx = rows.map(function (r) { return Math.log2(r.d_k); });
      var x0 = Math.min.apply(null, lx), x1 = Math.max.apply(null, lx);
      var panels = [["max_weight", "lab.col_max_weight", false], ["grad_norm", "lab.col_grad", true]];
      var PW = 200, PH = 130, T0 = 22;
      panels.forEach(function (p, k) {
        var L0 = 40 + k * (PW + 60), vals = [];
        rows.forEach(function (r) { vals.push(r[p[0]], r[p[0] + "_scaled"]); });
        var f = p[2] ? function (v) { return Math.log10(Math.max(v, 1e-300)); } : function (v) { return v; };
        var lo = p[2] ? Math.floor(Math.min.apply(null, vals.map(f))) : 0;
        var hi = p[2] ? Math.ceil(Math.max.apply(null, vals.map(f))) : 1;
        if (hi <= lo) hi = lo + 1;
        var X = function (n) { return L0 + (x1 > x0 ? (lx[n] - x0) / (x1 - x0) : 0.5) * PW; };
        var Y = function (v) { return T0 + PH - (f(v) - lo) / (hi - lo) * PH; };
        ctx.strokeStyle = "#cbd2d9"; ctx.lineWidth = 1; ctx.setLineDash([]);
        ctx.strokeRect(L0 - 0.5, T0 - 0.5, PW + 1, PH + 1);
        ctx.fillStyle = "#1f2933"; ctx.font = "11px sans-serif"; ctx.textAlign = "left"; ctx.textBaseline = "alphabetic";
        ctx.fillText(msg(p[1]), L0, T0 - 8, PW);
        ctx.fillStyle = "#616e7c"; ctx.textAlign = "right"; ctx.textBaseline = "middle";
        ctx.fillText(p[2] ? "1e" + hi : String(hi), L0 - 4, T0); ctx.fillText(p[2] ? "1e" + lo : String(lo), L0 - 4, T0 + PH);
        ctx.textAlign = "center"; ctx.textBaseline = "top";
        rows.forEach(function (r, n) { if (n % 2 === 0 || n === rows.length - 1) ctx.fillText(String(r.d_k), X(n), T0 + PH + 4); });
        [["", WHY_UNSCALED], ["_scaled", WHY_SCALED]].forEach(function (s) {
          ctx.strokeStyle = s[1]; ctx.fillStyle = s[1]; ctx.lineWidth = 1.5;
          ctx.beginPath();
          rows.forEach(function (r, n) { var y = Y(r[p[0] + s[0]]); if (n === 0) ctx.moveTo(X(n), y); else ctx.lineTo(X(n), y); });
          ctx.stroke();
          rows.forEach(function (r, n) { ctx.beginPath(); ctx.arc(X(n), Y(r[p[0] + s[0]]), n === state.n ? 4 : 2, 0, 2 * Math.PI); ctx.fill(); });
        });
        ctx.strokeStyle = "#c81e1e"; ctx.setLineDash([4, 3]); ctx.lineWidth = 1;
        ctx.beginPath(); ctx.moveTo(X(state.n), T0); ctx.lineTo(X(state.n), T0 + PH); ctx.stroke();
        ctx.setLineDash([]);
      });
      ctx.textAlign = "left"; ctx.textBaseline = "middle"; ctx.font = "11px sans-serif";
      ctx.fillStyle = WHY_UNSCALED; ctx.fillText("\u25cf " + msg("lab.unscaled"), 40, CH - 10);
      ctx.fillStyle = WHY_SCALED; ctx.fillText("\u25cf " + msg("lab.scaled"), 160, CH - 10);
      curves.setAttribute("data-dk", String(rows[state.n].d_k));
    }
    function go(n) {
      state.n = Math.max(0, Math.min(rows.length - 1, n));
      range.value = String(state.n);
      var r = rows[state.n], ex = examples[state.n];
      shown.textContent = msg("page.why_dk", { d: r.d_k });
      Object.keys(cells).forEach(function (key) { cells[key].textContent = String(r[key]); });
      theoryLine.textContent = msg("page.why_theory", { d: r.d_k, keys: keys, mw: num(theory.uniform_max_weight),
                                                        ent: num(theory.uniform_entropy) });
      barsTitle.textContent = msg("page.why_bars_title", { keys: keys, d: r.d_k });
      bars.setAttribute("aria-label", barsTitle.textContent);
      var best = 0;
      ex.weights.forEach(function (w, j) { if (w > ex.weights[best]) best = j; });
      showBar(best);
      drawCurves();
    }
    range.addEventListener("input", function () { go(Number(range.value)); });
    go(start);
  }

  function renderNotices(list) {
    var box = document.getElementById("notices");
    (list || []).forEach(function (n, i) {
      box.appendChild(el("p", { "class": "warn notice", "data-testid": "notice-" + i, "role": "status" }, msg(n.key, n.args)));
    });
  }
  // One view failing (a browser out of memory, say) says so on the page; the others still work.
  function guarded(fn, name) {
    try { fn(); } catch (err) {
      renderNotices([{ key: "page.view_failed", args: { view: name, error: String(err && err.message || err) } }]);
      if (window.console) console.error(err);
    }
  }

  // ------------------------------------------------------------------ start
  // The template's own words (written in English in template.html: its text and its sections' aria-labels) in
  // the page's language.
  function setText(selector, text) { var n = document.querySelector(selector); if (n) n.textContent = text; }
  if (DATA.lang) document.documentElement.setAttribute("lang", DATA.lang);
  setText("header .lead", msg("page.lead"));
  setText("#playground > h2", msg("page.playground"));
  setText("#arith", msg("page.hover"));
  [["playground", "page.section_playground"], ["example", "page.section_example"],
   ["generation", "page.section_generation"], ["model", "page.section_model"], ["compare", "page.section_compare"], ["long", "page.section_long"]].forEach(function (s) {
    document.getElementById(s[0]).setAttribute("aria-label", msg(s[1]));
  });
  var generator = document.querySelector('meta[name="generator"]');
  setText("footer", msg("page.footer", { version: generator ? generator.getAttribute("content").replace(/^qkv /, "") : "" }));
  renderNotices(DATA.notices);
  if (FOLDED) foldPage();
  if (initial) { resetState(); renderAll(); }
  else {
    document.getElementById("playground").hidden = true;
    document.querySelector("header .lead").hidden = true;          // it describes the playground
    if (!FOLDED) {
      document.getElementById("title").textContent =
        DATA.example ? DATA.example.name : DATA.generation ? msg("page.gen_title", { name: DATA.generation.name })
        : DATA.model ? msg("page.model_title", { name: DATA.model.name }) : "qkv";
    }
  }
  if (DATA.why) guarded(function () { renderWhy(DATA.why); }, "why");
  if (DATA.example) guarded(function () { renderAtlas(DATA.example, document.getElementById("example"), "example"); }, "example");
  if (DATA.generation) guarded(function () { renderGeneration(DATA.generation); }, "generation");
  if (DATA.model) guarded(function () { renderAtlas(DATA.model, document.getElementById("model"), "model"); }, "model");
  if (DATA.compare) guarded(function () { renderCompare(DATA.compare); }, "compare");
  if (DATA.long) guarded(function () { renderLong(DATA.long); }, "long");
  // First paint done: every view drawn. The browser tests read the time since navigation started.
  document.body.setAttribute("data-ready-ms", String(Math.round(performance.now())));
  document.body.setAttribute("data-ready", "true");
})();
