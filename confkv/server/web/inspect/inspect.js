// CONF-KV cache inspector: runs a request compressed and uncompressed, draws which (layer, token) KV
// entries the compressed one kept FULL, KEY_ONLY or dropped at each compression, and polls /metrics.
// Plain browser JavaScript, no build step; `window.inspector` exposes the state the browser test reads.
"use strict";

(() => {
  const FULL = 2;
  const KEY_ONLY = 1;
  const DROPPED = 0;
  const ABSENT = 255; // position not in the cache at that compression (written later)
  const TIER_NAMES = { [FULL]: "FULL", [KEY_ONLY]: "KEY_ONLY", [DROPPED]: "dropped" };
  const MARGIN = { left: 34, top: 16, bottom: 2 }; // layer numbers on the left, prompt | generated on top
  const METRICS_EVERY_MS = 2000;

  const $ = (id) => document.getElementById(id);

  const state = {
    data: null, // the GET /inspect/requests/{id} record shown
    index: 0, // which compression the slider shows
    tierCache: new Map(), // "c/layer" -> Uint8Array of tiers by position
    valueCache: new Map(), // "c/layer/field" -> Float32Array or null
    geom: null, // the map's last layout, for hovering
    colours: null,
  };

  const inspector = {
    status: "idle", // idle | running | done | error
    requestId: null,
    renderMs: null, // the last token-map render (slider move or new record)
    loadMs: null, // the last record shown: checks, layout and first render
    compare: null, // { identical, divergence, rougeL } of the last run
    response: null, // the last compressed POST /generate answer
    plainResponse: null, // and the uncompressed one (null if it failed)
    live: null, // the last /metrics figures
  };

  // ---------- decoding the record ----------

  /** A half-precision float (as a 16-bit integer) as a number. */
  function halfToFloat(h) {
    const sign = h & 0x8000 ? -1 : 1;
    const exp = (h >> 10) & 0x1f;
    const frac = h & 0x3ff;
    if (exp === 0) return sign * frac * 2 ** -24;
    if (exp === 31) return frac ? NaN : sign * Infinity;
    return sign * (1 + frac / 1024) * 2 ** (exp - 15);
  }

  /** base64 of little-endian float16 values -> Float32Array (null stays null). */
  function decodeHalfs(b64) {
    if (b64 == null) return null;
    const bytes = atob(b64);
    const out = new Float32Array(bytes.length >> 1);
    for (let i = 0; i < out.length; i++) {
      out[i] = halfToFloat(bytes.charCodeAt(2 * i) | (bytes.charCodeAt(2 * i + 1) << 8));
    }
    return out;
  }

  /** Run-length tiers [tier, count, ...] -> one tier per position 0..n-1. */
  function decodeTiers(rle, n) {
    const out = new Uint8Array(n).fill(ABSENT);
    let pos = 0;
    for (let i = 0; i + 1 < rle.length && pos < n; i += 2) {
      const end = Math.min(n, pos + rle[i + 1]);
      out.fill(rle[i], pos, end);
      pos = end;
    }
    return out;
  }

  function compressions() {
    return state.data ? state.data.compressions : [];
  }

  function tierArray(c, layer) {
    const key = `${c}/${layer}`;
    let tiers = state.tierCache.get(key);
    if (!tiers) {
      const comp = compressions()[c];
      tiers = decodeTiers(comp.layers[layer].tiers, comp.num_tokens);
      state.tierCache.set(key, tiers);
    }
    return tiers;
  }

  /** field "scores" or "retention" of a layer at compression c: Float32Array, or null if not scored then. */
  function valueArray(c, layer, field) {
    const key = `${c}/${layer}/${field}`;
    if (!state.valueCache.has(key)) state.valueCache.set(key, decodeHalfs(compressions()[c].layers[layer][field]));
    return state.valueCache.get(key);
  }

  /** Entries by tier at compression c, over all layers, summed from the runs. */
  function countTiers(c) {
    const counts = { full: 0, key_only: 0, dropped: 0 };
    const comp = compressions()[c];
    if (!comp) return counts;
    const names = { [FULL]: "full", [KEY_ONLY]: "key_only", [DROPPED]: "dropped" };
    for (const layer of comp.layers) {
      for (let i = 0; i + 1 < layer.tiers.length; i += 2) counts[names[layer.tiers[i]]] += layer.tiers[i + 1];
    }
    return counts;
  }

  /** Every tier change of one entry: an entry is written FULL, so a first state below FULL is a change. */
  function tierHistory(layer, pos) {
    const changes = [];
    let previous = FULL;
    compressions().forEach((comp, c) => {
      if (pos >= comp.num_tokens) return;
      const tier = tierArray(c, layer)[pos];
      if (tier !== previous && tier !== ABSENT) {
        changes.push({ index: c, step: comp.step, from: previous, to: tier });
        previous = tier;
      }
    });
    return changes;
  }

  /** The latest value of `field` for an entry at or before compression c: { value, step } or null. */
  function latestValue(c, layer, pos, field) {
    for (let k = c; k >= 0; k--) {
      const values = valueArray(k, layer, field);
      if (values && pos < values.length && !Number.isNaN(values[pos])) {
        return { value: values[pos], step: compressions()[k].step };
      }
    }
    return null;
  }

  // ---------- the token map ----------

  function cssColour(name) {
    const hex = getComputedStyle(document.documentElement).getPropertyValue(name).trim().replace("#", "");
    const [r, g, b] = [0, 2, 4].map((i) => parseInt(hex.slice(i, i + 2), 16));
    return { css: `#${hex}`, packed: ((255 << 24) | (b << 16) | (g << 8) | r) >>> 0 }; // RGBA bytes, little-endian
  }

  function colours() {
    if (!state.colours) {
      state.colours = {
        [FULL]: cssColour("--full"),
        [KEY_ONLY]: cssColour("--key-only"),
        [DROPPED]: cssColour("--dropped"),
        [ABSENT]: cssColour("--absent"),
        boundary: cssColour("--boundary"),
      };
    }
    return state.colours;
  }

  /** Where everything goes on the canvas, in canvas pixels. */
  function layout(canvas, numLayers, numTokens) {
    const width = Math.max(240, Math.floor(canvas.clientWidth || canvas.width));
    const rowH = Math.max(3, Math.min(14, Math.floor(480 / numLayers)));
    const plotW = width - MARGIN.left;
    return {
      width,
      height: MARGIN.top + numLayers * rowH + MARGIN.bottom,
      rowH,
      plotW,
      numLayers,
      numTokens,
      cols: Math.min(numTokens, plotW), // one image column per token, or several tokens per column
    };
  }

  /**
   * The tier one image column shows for positions [t0, t1) of a layer. With several tokens per pixel
   * column it is the MAJORITY tier among the positions in the cache (a tie goes to the lower tier, so
   * an even split shows the loss); positions not yet in the cache count only when none is.
   */
  function columnTier(tiers, t0, t1) {
    if (t1 - t0 === 1) return t0 < tiers.length ? tiers[t0] : ABSENT;
    let dropped = 0;
    let keyOnly = 0;
    let full = 0;
    for (let t = t0; t < t1 && t < tiers.length; t++) {
      const tier = tiers[t];
      if (tier === FULL) full++;
      else if (tier === KEY_ONLY) keyOnly++;
      else if (tier === DROPPED) dropped++;
    }
    if (dropped + keyOnly + full === 0) return ABSENT;
    if (dropped >= keyOnly && dropped >= full) return DROPPED;
    return keyOnly >= full ? KEY_ONLY : FULL;
  }

  /** The map as a cols x layers image, one pixel per column and layer. */
  function mapImage(ctx, geom, c) {
    const image = ctx.createImageData(geom.cols, geom.numLayers);
    const pixels = new Uint32Array(image.data.buffer);
    const palette = colours();
    const packed = new Uint32Array(256).fill(palette[ABSENT].packed);
    for (const tier of [FULL, KEY_ONLY, DROPPED]) packed[tier] = palette[tier].packed;
    const perCol = geom.numTokens / geom.cols;
    for (let layer = 0; layer < geom.numLayers; layer++) {
      const tiers = tierArray(c, layer);
      const row = layer * geom.cols;
      for (let col = 0; col < geom.cols; col++) {
        const t0 = Math.floor(col * perCol);
        const t1 = Math.max(t0 + 1, Math.floor((col + 1) * perCol));
        pixels[row + col] = packed[columnTier(tiers, t0, t1)];
      }
    }
    return image;
  }

  function drawAxes(ctx, geom, numPrompt) {
    const palette = colours();
    const plotH = geom.numLayers * geom.rowH;
    ctx.fillStyle = "#fff";
    if (geom.rowH >= 6) {
      for (let layer = 1; layer < geom.numLayers; layer++) {
        ctx.fillRect(MARGIN.left, MARGIN.top + layer * geom.rowH, geom.plotW, 1);
      }
    }
    const x = MARGIN.left + (numPrompt * geom.plotW) / geom.numTokens;
    ctx.fillStyle = palette.boundary.css;
    ctx.fillRect(Math.round(x) - 1, MARGIN.top - 4, 2, plotH + 4);
    ctx.font = "11px system-ui, sans-serif";
    ctx.textBaseline = "bottom";
    ctx.fillStyle = "#374151";
    const prompt = `\u2190 prompt: ${numPrompt} tokens`;
    const generated = `generated: ${geom.numTokens - numPrompt} \u2192`;
    if (geom.width - x - 4 >= ctx.measureText(generated).width) {
      ctx.textAlign = "right";
      ctx.fillText(prompt, Math.max(MARGIN.left + ctx.measureText(prompt).width, x - 4), MARGIN.top - 2);
      ctx.textAlign = "left";
      ctx.fillText(generated, x + 4, MARGIN.top - 2);
    } else {
      ctx.textAlign = "right"; // no room right of the line: both labels left of it
      ctx.fillText(`${prompt} | ${generated}`, x - 4, MARGIN.top - 2);
    }
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    const every = Math.ceil(12 / geom.rowH);
    for (let layer = 0; layer < geom.numLayers; layer += every) {
      ctx.fillText(`L${layer}`, MARGIN.left - 4, MARGIN.top + (layer + 0.5) * geom.rowH);
    }
  }

  function renderMap() {
    const started = performance.now();
    const data = state.data;
    const canvas = $("map");
    const geom = layout(canvas, data.num_layers, data.tokens.length);
    canvas.width = geom.width;
    canvas.height = geom.height;
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, geom.width, geom.height);
    const image = mapImage(ctx, geom, state.index);
    const offscreen = document.createElement("canvas");
    offscreen.width = geom.cols;
    offscreen.height = geom.numLayers;
    offscreen.getContext("2d").putImageData(image, 0, 0);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(offscreen, MARGIN.left, MARGIN.top, geom.plotW, geom.numLayers * geom.rowH);
    drawAxes(ctx, geom, data.num_prompt_tokens);
    state.geom = geom;
    inspector.renderMs = performance.now() - started;
  }

  /** The (layer, position) under canvas pixel (x, y), or null. */
  function cellAt(x, y) {
    const g = state.geom;
    if (!g) return null;
    const layer = Math.floor((y - MARGIN.top) / g.rowH);
    const pos = Math.floor(((x - MARGIN.left) * g.numTokens) / g.plotW);
    if (layer < 0 || layer >= g.numLayers || pos < 0 || pos >= g.numTokens) return null;
    return { layer, pos };
  }

  /** The centre of a cell in CSS pixels from the canvas's top-left corner (for tests and links). */
  function cellCenter(layer, pos) {
    const g = state.geom;
    const canvas = $("map");
    const scale = canvas.getBoundingClientRect().width / canvas.width;
    const x = MARGIN.left + ((pos + 0.5) * g.plotW) / g.numTokens;
    const y = MARGIN.top + (layer + 0.5) * g.rowH;
    return { x: x * scale, y: y * scale };
  }

  /** A token as one visible line: newlines and tabs shown as symbols. */
  function visibleToken(text) {
    return text.replace(/\n/g, "\u21b5").replace(/\t/g, "\u2192");
  }

  function fmtValue(found) {
    if (!found) return "not scored";
    const here = found.step === compressions()[state.index].step ? "" : ` (scored at step ${found.step})`;
    return `${found.value.toFixed(4)}${here}`;
  }

  function tooltipLines(layer, pos) {
    const data = state.data;
    const comp = compressions()[state.index];
    const part = pos < data.num_prompt_tokens ? "prompt" : "generated";
    const lines = [`position ${pos} (${part}) \u00b7 layer ${layer}`];
    if (pos >= comp.num_tokens) {
      lines.push(`not in the cache at step ${comp.step} (written later)`);
    } else {
      lines.push(`tier: ${TIER_NAMES[tierArray(state.index, layer)[pos]]}`);
      lines.push(`score: ${fmtValue(latestValue(state.index, layer, pos, "scores"))}`);
      lines.push(`retention: ${fmtValue(latestValue(state.index, layer, pos, "retention"))}`);
    }
    const changes = tierHistory(layer, pos);
    const told = changes.map((ch) => {
      const later = ch.index > state.index ? " (later)" : "";
      return `step ${ch.step}: ${TIER_NAMES[ch.from]} \u2192 ${TIER_NAMES[ch.to]}${later}`;
    });
    lines.push(told.length ? `tier changed at ${told.join("; ")}` : "tier never changed (FULL)");
    return lines;
  }

  function showTooltip(event) {
    const canvas = $("map");
    const rect = canvas.getBoundingClientRect();
    const scale = canvas.width / rect.width;
    const cell = state.data && cellAt((event.clientX - rect.left) * scale, (event.clientY - rect.top) * scale);
    const tip = $("tooltip");
    if (!cell) {
      tip.hidden = true;
      return;
    }
    const token = document.createElement("span");
    token.className = "tok";
    token.textContent = visibleToken(state.data.tokens[cell.pos] ?? "");
    tip.replaceChildren(token, document.createTextNode(`\n${tooltipLines(cell.layer, cell.pos).join("\n")}`));
    tip.hidden = false;
    const x = event.clientX - rect.left;
    const y = event.clientY - rect.top;
    tip.style.left = `${x + 14 + tip.offsetWidth > rect.width ? x - 14 - tip.offsetWidth : x + 14}px`;
    tip.style.top = `${y + 14}px`;
    inspector.hovered = cell;
  }

  // ---------- the slider and the bars ----------

  function stepLabel(c) {
    const comps = compressions();
    const comp = comps[c];
    const notes = [];
    if (c === 0) notes.push("end of prefill");
    if (comp.final) notes.push("final");
    const note = notes.length ? ` (${notes.join(", ")})` : "";
    return `step ${comp.step}${note} \u00b7 compression ${c + 1} of ${comps.length} \u00b7 ${comp.num_tokens} tokens`;
  }

  function setStep(c) {
    const comps = compressions();
    if (!comps.length) return;
    state.index = Math.max(0, Math.min(comps.length - 1, Math.trunc(c)));
    $("step").value = String(state.index);
    $("step-label").textContent = stepLabel(state.index);
    renderMap();
    renderBars();
    const counts = countTiers(state.index);
    const total = counts.full + counts.key_only + counts.dropped;
    $("map-counts").textContent =
      `${total} entries: FULL ${counts.full} \u00b7 KEY_ONLY ${counts.key_only} \u00b7 dropped ${counts.dropped}` +
      " (with several tokens per pixel column, a column shows its majority tier)";
    $("tooltip").hidden = true;
  }

  function fmtBytes(bytes) {
    if (bytes == null || Number.isNaN(bytes)) return "\u2013";
    const units = ["B", "KiB", "MiB", "GiB"];
    let value = bytes;
    let unit = 0;
    while (Math.abs(value) >= 1024 && unit < units.length - 1) {
      value /= 1024;
      unit++;
    }
    return `${unit ? value.toFixed(1) : value} ${units[unit]}`;
  }

  /** Bytes each layer holds by tier at compression c: [{ full, key_only }] (dropped entries hold none). */
  function layerBytes(c) {
    const comp = compressions()[c];
    const perEntry = state.data.entry_bytes;
    return comp.layers.map((layer) => {
      const bytes = { full: 0, key_only: 0 };
      for (let i = 0; i + 1 < layer.tiers.length; i += 2) {
        if (layer.tiers[i] === FULL) bytes.full += layer.tiers[i + 1] * perEntry.full;
        if (layer.tiers[i] === KEY_ONLY) bytes.key_only += layer.tiers[i + 1] * perEntry.key_only;
      }
      return bytes;
    });
  }

  function barRow(label, bytes, whole) {
    const name = document.createElement("span");
    name.textContent = label;
    const bar = document.createElement("div");
    bar.className = "bar";
    for (const [cls, value] of [["full", bytes.full], ["key-only", bytes.key_only]]) {
      const part = document.createElement("i");
      part.className = cls;
      part.style.width = `${whole ? (100 * value) / whole : 0}%`;
      part.title = `${cls === "full" ? "FULL" : "KEY_ONLY"}: ${fmtBytes(value)}`;
      bar.append(part);
    }
    const num = document.createElement("span");
    num.className = "num";
    num.textContent = `${fmtBytes(bytes.full + bytes.key_only)}`;
    return [name, bar, num];
  }

  function renderBars() {
    const comp = compressions()[state.index];
    const perLayer = layerBytes(state.index);
    const whole = comp.num_tokens * state.data.entry_bytes.full; // a layer with every entry FULL
    const total = perLayer.reduce((sum, b) => ({ full: sum.full + b.full, key_only: sum.key_only + b.key_only }), {
      full: 0,
      key_only: 0,
    });
    const rows = [barRow("all", total, whole * perLayer.length)];
    perLayer.forEach((bytes, layer) => rows.push(barRow(`L${layer}`, bytes, whole)));
    $("bars").replaceChildren(...rows.flat());
    $("bars").title = `bar = a layer with all ${comp.num_tokens} entries FULL (${fmtBytes(whole)})`;
  }

  // ---------- showing a record ----------

  function checkRecord(data) {
    for (const key of ["tokens", "num_layers", "num_prompt_tokens", "entry_bytes", "compressions"]) {
      if (data[key] == null) throw new Error(`the inspect record lacks "${key}"`);
    }
  }

  /** Show a GET /inspect/requests/{id} record at its final compression; returns the timings. */
  function show(data) {
    const started = performance.now();
    checkRecord(data);
    state.data = data;
    state.tierCache.clear();
    state.valueCache.clear();
    inspector.requestId = data.id ?? null;
    const comps = data.compressions;
    const slider = $("step");
    slider.max = String(Math.max(0, comps.length - 1));
    slider.disabled = comps.length < 2;
    const p = data.params || {};
    $("map-title").textContent =
      `${data.id ?? ""} \u00b7 ${data.num_layers} layers \u00b7 ${data.tokens.length} tokens ` +
      `(${data.num_prompt_tokens} prompt) \u00b7 ${p.policy ?? "?"} @ ${p.compression_rate ?? "?"}, ` +
      `${p.kv_cache_dtype ?? "?"}`;
    if (!comps.length) {
      state.geom = null;
      const canvas = $("map");
      canvas.getContext("2d").clearRect(0, 0, canvas.width, canvas.height);
      $("step-label").textContent = "no compression recorded for this request";
      $("map-counts").textContent = "";
      $("bars").replaceChildren();
      inspector.renderMs = 0;
      inspector.loadMs = performance.now() - started;
      return { renderMs: 0, loadMs: inspector.loadMs };
    }
    setStep(comps.length - 1);
    inspector.loadMs = performance.now() - started;
    return { renderMs: inspector.renderMs, loadMs: inspector.loadMs };
  }

  // ---------- compressed against uncompressed ----------

  function words(text) {
    return text.split(/\s+/).filter(Boolean);
  }

  /** The index of the first word where two word lists differ, or -1 when they are equal. */
  function firstDivergence(a, b) {
    let i = 0;
    while (i < a.length && i < b.length && a[i] === b[i]) i++;
    return i === a.length && i === b.length ? -1 : i;
  }

  /** ROUGE-L F-measure (beta 1): longest common subsequence over whitespace words. */
  function rougeL(candidate, reference) {
    if (!candidate.length || !reference.length) return candidate.length === reference.length ? 1 : 0;
    let prev = new Int32Array(reference.length + 1);
    let row = new Int32Array(reference.length + 1);
    for (const word of candidate) {
      for (let j = 1; j <= reference.length; j++) {
        row[j] = word === reference[j - 1] ? prev[j - 1] + 1 : Math.max(prev[j], row[j - 1]);
      }
      [prev, row] = [row, prev];
    }
    const lcs = prev[reference.length];
    if (!lcs) return 0;
    const precision = lcs / candidate.length;
    const recall = lcs / reference.length;
    return (2 * precision * recall) / (precision + recall);
  }

  /** An answer with its word `mark` highlighted (past its end: an end marker); -1 marks nothing. */
  function renderAnswer(el, text, mark) {
    el.replaceChildren();
    let wordIndex = 0;
    for (const piece of text.split(/(\s+)/)) {
      if (!piece) continue;
      const isWord = !/^\s+$/.test(piece);
      let node;
      if (isWord && mark >= 0 && wordIndex === mark) {
        node = document.createElement("mark");
        node.className = "diverge";
        node.textContent = piece;
      } else if (mark >= 0 && wordIndex > mark) {
        node = document.createElement("span");
        node.className = "after";
        node.textContent = piece;
      } else {
        node = document.createTextNode(piece);
      }
      if (isWord) wordIndex++;
      el.append(node);
    }
    if (mark >= 0 && mark >= wordIndex) {
      const end = document.createElement("mark");
      end.className = "diverge";
      end.textContent = "\u27c2 ends here";
      el.append(" ", end);
    }
  }

  function fmtMetric(key, value) {
    if (value == null) return "\u2013";
    if (key === "entries") {
      return Object.entries(value)
        .map(([k, v]) => `${k} ${v}`)
        .join(" \u00b7 ");
    }
    if (key.endsWith("_size")) return `${fmtBytes(value)} (${value} B)`;
    if (key.endsWith("_ms")) return `${value.toFixed(1)} ms`;
    if (typeof value === "number" && !Number.isInteger(value)) return value.toFixed(4);
    return typeof value === "object" ? JSON.stringify(value) : String(value);
  }

  function renderMetrics(metrics, usage) {
    const rows = Object.entries(metrics || {});
    if (usage) rows.push(["usage", Object.entries(usage).map(([k, v]) => `${k} ${v}`).join(" \u00b7 ")]);
    $("metrics-table").replaceChildren(
      ...rows.map(([key, value]) => {
        const tr = document.createElement("tr");
        const name = document.createElement("td");
        name.textContent = key;
        const cell = document.createElement("td");
        cell.textContent = key === "usage" ? value : fmtMetric(key, value);
        tr.append(name, cell);
        return tr;
      }),
    );
  }

  /** Both answers side by side: the first divergent word marked in both, and their ROUGE-L. */
  function renderCompare(compressedText, plainText, plainError) {
    const summary = $("compare-summary");
    if (plainText == null) {
      renderAnswer($("text-compressed"), compressedText, -1);
      $("text-plain").textContent = plainError || "no uncompressed run for this request";
      summary.textContent = plainError ? "The uncompressed run failed." : "Only the compressed answer is known.";
      inspector.compare = null;
      return;
    }
    const a = words(compressedText);
    const b = words(plainText);
    const divergence = firstDivergence(a, b);
    const score = rougeL(a, b);
    renderAnswer($("text-compressed"), compressedText, divergence);
    renderAnswer($("text-plain"), plainText, divergence);
    inspector.compare = { identical: divergence < 0, divergence, rougeL: score };
    const same = divergence < 0 ? `identical answers (${a.length} words)` : `first divergence at word ${divergence}`;
    summary.textContent = `ROUGE-L F ${score.toFixed(3)} (longest common subsequence of whitespace words) \u00b7 ${same}`;
  }

  // ---------- the live panel ----------

  /** Prometheus text -> { "name{labels}": value } (labels as written by the server). */
  function parsePrometheus(text) {
    const samples = {};
    for (const line of text.split("\n")) {
      const match = /^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?)\s+(\S+)/.exec(line);
      if (match) samples[match[1]] = Number(match[2]);
    }
    return samples;
  }

  function liveFigures(samples) {
    return {
      running: samples['kv_cache_bytes{pool="running"}'] ?? 0,
      prefix: samples['kv_cache_bytes{pool="prefix"}'] ?? 0,
      audit: samples['kv_cache_bytes{pool="audit"}'] ?? 0,
      capacity: samples.kv_cache_capacity_bytes ?? 0,
      requests: samples.requests_running ?? 0,
    };
  }

  function renderLive(live) {
    const pools = ["running", "prefix", "audit"];
    $("pool-bar").replaceChildren(
      ...pools.map((pool) => {
        const part = document.createElement("i");
        part.className = pool;
        part.style.width = `${live.capacity ? Math.min(100, (100 * live[pool]) / live.capacity) : 0}%`;
        part.title = `${pool}: ${fmtBytes(live[pool])}`;
        return part;
      }),
    );
    const rows = pools.map((pool) => {
      const share = live.capacity ? ` (${((100 * live[pool]) / live.capacity).toFixed(1)}%)` : "";
      return [`KV ${pool}`, `${fmtBytes(live[pool])}${share}`, pool];
    });
    rows.push(["capacity", fmtBytes(live.capacity)], ["requests running", String(live.requests)]);
    $("live-figures").replaceChildren(
      ...rows.flatMap(([name, value, pool]) => {
        const dt = document.createElement("dt");
        if (pool) {
          const sw = document.createElement("i");
          sw.className = "sw";
          sw.style.background = `var(--${pool === "running" ? "full" : pool})`;
          dt.append(sw);
        }
        dt.append(name);
        const dd = document.createElement("dd");
        dd.textContent = value;
        return [dt, dd];
      }),
    );
  }

  async function pollMetrics() {
    try {
      const response = await fetch("/metrics", { credentials: "same-origin", cache: "no-store" });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      inspector.live = liveFigures(parsePrometheus(await response.text()));
      renderLive(inspector.live);
      $("live-error").textContent = "";
    } catch (err) {
      $("live-error").textContent = `metrics unavailable: ${err.message}`;
    } finally {
      setTimeout(pollMetrics, METRICS_EVERY_MS);
    }
  }

  // ---------- running a request ----------

  /** What an error answer says: { error: { type, message, fields? } }, or the status alone. */
  function errorMessage(status, payload) {
    const error = payload && payload.error;
    if (!error) return `HTTP ${status}`;
    let text = `${status} ${error.type ?? "error"}: ${error.message ?? ""}`;
    if (error.fields) text += `\n${typeof error.fields === "string" ? error.fields : JSON.stringify(error.fields)}`;
    return text;
  }

  async function callJSON(url, body) {
    const init = { credentials: "same-origin", headers: { Accept: "application/json" } };
    if (body !== undefined) {
      init.method = "POST";
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    let response;
    try {
      response = await fetch(url, init);
    } catch (err) {
      return { ok: false, message: `the server could not be reached: ${err.message}` };
    }
    let payload = null;
    try {
      payload = await response.json();
    } catch {
      payload = null;
    }
    return response.ok ? { ok: true, body: payload } : { ok: false, message: errorMessage(response.status, payload) };
  }

  function numberField(id) {
    const value = Number($(id).value);
    if ($(id).value === "" || Number.isNaN(value)) throw new Error(`${id} must be a number`);
    return value;
  }

  /** The request body both runs share: the prompt (or chat) and the generation options. */
  function generationBody() {
    const text = $("prompt").value;
    const body = $("chat").checked ? { messages: [{ role: "user", content: text }] } : { prompt: text };
    body.max_tokens = numberField("max-tokens");
    body.temperature = numberField("temperature");
    return body;
  }

  function compressionOptions() {
    const options = {
      policy: $("policy").value,
      compression_rate: numberField("rate"),
      kv_cache_dtype: $("dtype").value,
    };
    if (options.policy === "dynamic") options.thresholds = { high: numberField("high"), medium: numberField("medium") };
    return options;
  }

  function setBusy(busy, message) {
    $("run").disabled = busy;
    $("run-status").textContent = message || "";
  }

  function showError(message) {
    $("error").textContent = message;
    $("error").hidden = !message;
  }

  async function run(event) {
    event.preventDefault();
    showError("");
    let base;
    let compression;
    try {
      base = generationBody();
      compression = compressionOptions();
    } catch (err) {
      showError(err.message);
      return;
    }
    inspector.status = "running";
    setBusy(true, "generating, compressed and uncompressed\u2026");
    try {
      const [compressed, plain] = await Promise.all([
        callJSON("/generate", { ...base, inspect: true, compression_stats: true, compression }),
        callJSON("/generate", { ...base, compression: { enabled: false } }),
      ]);
      if (!compressed.ok) throw new Error(compressed.message);
      inspector.response = compressed.body;
      inspector.plainResponse = plain.ok ? plain.body : null;
      setBusy(true, "reading the cache record\u2026");
      const record = await callJSON(`/inspect/requests/${encodeURIComponent(compressed.body.id)}`);
      if (!record.ok) throw new Error(`cache record of ${compressed.body.id}: ${record.message}`);
      show(record.body);
      renderCompare(compressed.body.text, plain.ok ? plain.body.text : null, plain.ok ? null : plain.message);
      renderMetrics(compressed.body.compression_metrics, compressed.body.usage);
      history.replaceState(null, "", `?id=${encodeURIComponent(compressed.body.id)}`);
      inspector.status = "done";
      setBusy(false, `${compressed.body.id}: ${compressed.body.finish_reason ?? ""}`);
    } catch (err) {
      inspector.status = "error";
      showError(err.message);
      setBusy(false, "");
    }
  }

  /** Show a request recorded earlier (the page's ?id=), without an uncompressed run. */
  async function loadRequest(id) {
    inspector.status = "running";
    const record = await callJSON(`/inspect/requests/${encodeURIComponent(id)}`);
    if (!record.ok) {
      inspector.status = "error";
      showError(`cache record of ${id}: ${record.message}`);
      return;
    }
    show(record.body);
    if (record.body.prompt != null) $("prompt").value = record.body.prompt;
    renderCompare(record.body.text ?? "", null, null);
    renderMetrics(record.body.compression_metrics, null);
    inspector.status = "done";
  }

  function syncThresholds() {
    const dynamic = $("policy").value === "dynamic";
    $("high").disabled = !dynamic;
    $("medium").disabled = !dynamic;
  }

  function init() {
    $("run-form").addEventListener("submit", run);
    $("policy").addEventListener("change", syncThresholds);
    $("step").addEventListener("input", (event) => setStep(Number(event.target.value)));
    $("map").addEventListener("mousemove", showTooltip);
    $("map").addEventListener("mouseleave", () => {
      $("tooltip").hidden = true;
    });
    let resizeTimer = null;
    window.addEventListener("resize", () => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(() => state.data && state.data.compressions.length && setStep(state.index), 150);
    });
    syncThresholds();
    const id = new URLSearchParams(location.search).get("id");
    if (id) loadRequest(id);
    pollMetrics();
  }

  Object.assign(inspector, {
    show,
    setStep,
    step: () => state.index,
    numCompressions: () => compressions().length,
    cellCounts: () => countTiers(state.index),
    layerBytes: () => (state.data && compressions().length ? layerBytes(state.index) : []),
    cellCenter,
    tierHistory,
    rougeL: (a, b) => rougeL(words(a), words(b)),
    firstDivergence: (a, b) => firstDivergence(words(a), words(b)),
  });
  window.inspector = inspector;
  init();
})();
