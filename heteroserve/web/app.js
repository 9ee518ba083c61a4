// The chat page. Conversations are trees kept in IndexedDB: editing a message or regenerating an answer adds a
// sibling, so every alternative stays reachable ("2/3"). An answer is saved as it streams, keeps streaming when
// another conversation is opened, and one cut by a reload is shown as interrupted. Model output is Markdown rendered by markdown-it, with
// highlight.js and KaTeX, and always passed through DOMPurify before it reaches the page.

import { splitThinking, toSafeHtml } from "./markdown.js";
import { addNode, failed, importedConversations, isEmpty, leafOf, newConversation, pathOf, removeNode, store } from "./conversations.js";
import { channel, conversationStore, migrateLocalStorage, openTabs, TAB } from "./storage.js";
import { readAttachment, textWithFiles } from "./attachments.js";
const $ = (id) => document.getElementById(id);

// ---- rendering -----------------------------------------------------------------------------------------------
function renderMarkdown(element, text) {
  element.innerHTML = toSafeHtml(text);
  for (const pre of element.querySelectorAll("pre")) {
    const box = document.createElement("div");
    box.className = "code";
    pre.replaceWith(box);
    box.append(pre, copyButton("copy-code", "Copy the code", () => pre.innerText));
  }
  // What may scroll sideways (long code lines, wide tables and formulas) is reachable from the keyboard too.
  for (const wide of element.querySelectorAll("pre, table, .katex-display")) wide.tabIndex = 0;
}

async function copyText(text) {
  try { await navigator.clipboard.writeText(text); }
  catch { // not a secure context (a LAN address over http): the old way
    const area = Object.assign(document.createElement("textarea"), { value: text });
    document.body.append(area); area.select(); document.execCommand("copy"); area.remove();
  }
}
// A Copy button says "Copied" for a moment, and a screen reader hears it.
function copyButton(className, label, text) {
  const b = button("Copy", className, label, async () => {
    await copyText(text());
    b.textContent = "Copied";
    announce("Copied");
    setTimeout(() => { b.textContent = "Copy"; }, 1500);
  });
  return b;
}
function announce(text) {
  $("announce").textContent = "";
  setTimeout(() => { $("announce").textContent = text; }, 50); // a change, even when the same words come twice
}

function button(text, className, label, onClick) {
  const b = Object.assign(document.createElement("button"), { type: "button", className, textContent: text });
  b.setAttribute("aria-label", label);
  b.title = label;
  b.addEventListener("click", onClick);
  return b;
}

let conversations = []; // the list: [{id, title, updated, text}], newest first
let conv = null;
const streams = new Map(); // conversation id -> {conv, controller}: the answers this tab is streaming
// The open conversation is answering, here or in another tab (which would overwrite a message added here).
const streaming = () => !!conv && (streams.has(conv.id) || Object.values(conv.nodes).some((n) => n.streaming));
let renaming = false; // a title is being edited in the list: redrawing it would drop the field

const entryOf = (c) => ({ id: c.id, title: c.title, updated: c.updated,
                          text: Object.values(c.nodes).map((n) => n.content ?? "").join("\n").toLowerCase() });
function showInList(entry) {
  conversations = [entry, ...conversations.filter((e) => e.id !== entry.id)].sort((a, b) => b.updated - a.updated);
}
function remember(id) { // the conversation a reload reopens (this tab's), and a new tab opens
  sessionStorage.setItem("heteroserve.current", id);
  store.set("current", id);
}

// Writes this one conversation (an empty one waits for its first message), then tells the other tabs.
function saveConversation(c = conv) {
  if (c.deleted || isEmpty(c)) return;
  c.updated = Date.now();
  showInList(entryOf(c));
  renderList();
  conversationStore.put(c).then(() => { saveFailed = false; channel.postMessage({ type: "saved", id: c.id }); })
    .catch((e) => { if (!saveFailed) showNotice("Could not save: " + e.message); saveFailed = true; }); // said once
}
let saveFailed = false;
async function openConversation(id) {
  const previous = conv;
  let c = streams.get(id)?.conv;
  try { c ??= await conversationStore.get(id); } catch (e) { showNotice("Could not open: " + e.message); }
  if (previous && previous.id !== id && isEmpty(previous) && conversations.some((e) => e.id === previous.id)) {
    deleteConversation(previous.id, false);
  }
  conv = c ?? newConversation();
  remember(conv.id);
  closeSidebarOnPhone();
  render();
  renderList();
  settle(conv);
}
function startConversation() {
  if (conv && isEmpty(conv)) { $("input").focus(); closeSidebarOnPhone(); return; }
  conv = newConversation();
  remember(conv.id);
  render();
  renderList();
  closeSidebarOnPhone();
  $("input").focus();
}
function deleteConversation(id, openNext = true) {
  const stream = streams.get(id);
  if (stream) { stream.conv.deleted = true; stream.controller.abort(); }
  conversationStore.remove(id).then(() => channel.postMessage({ type: "deleted", id }))
    .catch((e) => showNotice("Could not delete: " + e.message));
  conversations = conversations.filter((e) => e.id !== id);
  if (openNext && conv?.id === id) { conv = null; openNewest(); }
  renderList();
}
function openNewest() { if (conversations.length) openConversation(conversations[0].id); else startConversation(); }
async function renameConversation(id, title) {
  if (!title.trim()) return;
  const c = conv?.id === id ? conv : streams.get(id)?.conv ?? await conversationStore.get(id);
  if (!c) return;
  c.title = title.trim().slice(0, 120);
  saveConversation(c);
  if (conv.id === id) $("title").textContent = c.title;
}

// An answer saved while it streamed whose tab is gone (reloaded, closed) was cut: it is marked interrupted. Whether
// that tab is open is known from its Web Lock, else from how recently the answer was saved (every 500 ms).
async function settle(c) {
  const others = Object.values(c.nodes).filter((n) => n.streaming && n.streaming !== TAB);
  if (!others.length) return;
  const tabs = await openTabs().catch(() => null);
  let live = 0;
  for (const n of others) {
    if (tabs ? tabs.has(n.streaming) : Date.now() - (n.streamedAt ?? 0) < 3000) { live += 1; continue; }
    n.interrupted = true;
    delete n.streaming; delete n.streamedAt;
  }
  if (live < others.length) { saveConversation(c); if (conv === c) render(); }
  if (live) setTimeout(() => { if (conv?.id === c.id) settle(conv); }, 1000); // still streaming elsewhere: look again
}

// What the other tabs did: the list follows, and the open conversation unless a message is being edited here; and
// what they ask: stop an answer streaming here.
channel.addEventListener("message", async ({ data }) => {
  if (data.type === "deleted") {
    conversations = conversations.filter((e) => e.id !== data.id);
    if (conv?.id === data.id && !streams.has(data.id)) openNewest();
    renderList();
  } else if (data.type === "saved" && !streams.has(data.id)) {
    const c = await conversationStore.get(data.id).catch(() => null);
    if (!c) return;
    showInList(entryOf(c));
    renderList();
    if (conv?.id === c.id && !$("log").querySelector(".edit-box")) {
      const log = $("log"), top = log.scrollTop, follow = nearBottom();
      conv = c;
      render();
      if (!follow) log.scrollTop = top;
    }
  } else if (data.type === "stop") {
    streams.get(data.id)?.controller.abort();
  } else if (data.type === "gone" && conv && Object.values(conv.nodes).some((n) => n.streaming === data.tab)) {
    settle(conv);
  }
});
window.addEventListener("pagehide", () => channel.postMessage({ type: "gone", tab: TAB }));

let shownList = null; // what the list shows: redrawn only when it changes (a save while streaming leaves it)
function renderList() {
  const list = $("conversations"), query = $("search").value.trim().toLowerCase();
  const shown = conversations.filter((e) => !query || e.title.toLowerCase().includes(query) || e.text.includes(query));
  $("no-matches").textContent = query && !shown.length ? `No conversation matches “${$("search").value.trim()}”` : "";
  const key = JSON.stringify([conv?.id, shown.map((e) => [e.id, e.title])]);
  if (renaming || key === shownList) return;
  shownList = key;
  list.innerHTML = "";
  for (const entry of shown) {
    const li = document.createElement("li");
    li.classList.toggle("current", entry.id === conv?.id);
    const open = button(entry.title, "open", "Open " + entry.title, () => openConversation(entry.id));
    if (entry.id === conv?.id) open.setAttribute("aria-current", "true");
    const rename = button("✎", "link rename", "Rename " + entry.title, () => {
      const field = Object.assign(document.createElement("input"), { value: entry.title });
      field.setAttribute("aria-label", "New title");
      const done = (keep) => {
        if (!renaming) return;
        renaming = false;
        shownList = null;
        if (keep) renameConversation(entry.id, field.value);
        renderList();
      };
      field.addEventListener("keydown", (e) => {
        if (e.key === "Enter") done(true);
        if (e.key === "Escape") { e.stopPropagation(); done(false); }
      });
      field.addEventListener("blur", () => done(true));
      open.replaceWith(field);
      renaming = true;
      field.focus(); field.select();
    });
    const remove = button("✕", "link delete", "Delete " + entry.title, () => {
      if (remove.classList.contains("armed")) { deleteConversation(entry.id); return; }
      remove.classList.add("armed"); remove.textContent = "Delete?"; // a second click within 4 s deletes
      setTimeout(() => { remove.classList.remove("armed"); remove.textContent = "✕"; }, 4000);
    });
    li.append(open, rename, remove);
    list.append(li);
  }
}

// ---- the messages ----------------------------------------------------------------------------------------------
const nearBottom = () => { const l = $("log"); return l.scrollHeight - l.scrollTop - l.clientHeight < 80; };

function render() {
  const log = $("log");
  log.innerHTML = "";
  $("title").textContent = conv.title;
  const path = pathOf(conv);
  if (!path.length) log.innerHTML = '<p class="empty">Start a conversation below.</p>';
  path.forEach((node, i) => log.append(messageElement(node, failed(path, i))));
  log.scrollTop = log.scrollHeight;
  setBusy(streaming());
  showContext();
}

function messageElement(node, isFailed) {
  const streaming = !!node.streaming; // here, or in another tab
  const div = document.createElement("div");
  div.className = `msg ${node.role}${node.role === "error" ? " error" : ""}${isFailed ? " failed" : ""}`;
  if (node.interrupted) div.classList.add("interrupted");
  div.dataset.id = node.id;
  const role = Object.assign(document.createElement("div"), { className: "role", textContent: node.role });
  div.append(role);
  if (node.images?.length) {
    const images = Object.assign(document.createElement("div"), { className: "images" });
    for (const url of node.images) images.append(Object.assign(document.createElement("img"), { src: url, alt: "attached image" }));
    div.append(images);
  }
  for (const file of node.files ?? []) div.append(fileElement(file));
  const body = Object.assign(document.createElement("div"), { className: "body" });
  if (node.role === "assistant") {
    const { thinking, answer, thinkingDone } = splitThinking(node.content);
    const reasoning = (node.reasoning ?? "") + thinking;
    if (reasoning) {
      const details = document.createElement("details");
      details.className = "reasoning";
      details.open = streaming && !answer;
      const summary = streaming && !(thinkingDone && answer) ? "Thinking…" : "Reasoning";
      details.append(Object.assign(document.createElement("summary"), { textContent: summary }),
                     Object.assign(document.createElement("div"), { className: "thinking", textContent: reasoning }));
      div.append(details);
    }
    for (const call of node.tools ?? []) div.append(toolCallElement(call));
    renderMarkdown(body, answer);
    if (streaming && !node.content && !reasoning && !node.tools) body.append(typingIndicator());
  } else if (node.role === "user") {
    renderMarkdown(body, node.content);
  } else {
    body.textContent = node.content;
  }
  div.append(body);
  const meta = [node.stats ? statsText(node.stats) : "", node.interrupted ? "interrupted" : ""].filter(Boolean).join(" · ");
  if (meta) div.append(Object.assign(document.createElement("div"), { className: "meta", textContent: meta }));
  if (!streaming) div.append(actionsElement(node));
  return div;
}

// Shown from the moment a question is sent until the first token comes.
function typingIndicator() {
  const dots = Object.assign(document.createElement("span"), { className: "typing", role: "status" });
  dots.setAttribute("aria-label", "Waiting for the answer");
  dots.append(...[0, 1, 2].map(() => document.createElement("span")));
  return dots;
}

// An attached file, folded: its name, and its text when opened.
function fileElement(file) {
  const details = Object.assign(document.createElement("details"), { className: "file" });
  const text = Object.assign(document.createElement("pre"), { textContent: file.text, tabIndex: 0 });
  details.append(Object.assign(document.createElement("summary"), { textContent: `${file.name} (${file.text.length} characters)` }), text);
  return details;
}

function toolCallElement(call) {
  let args = call.function?.arguments ?? "";
  try { args = JSON.stringify(JSON.parse(args), null, 2); } catch { /* still streaming, or not JSON: as sent */ }
  const details = document.createElement("details");
  details.className = "tool-call";
  details.open = true;
  details.append(Object.assign(document.createElement("summary"), { textContent: `Tool call: ${call.function?.name ?? "?"}` }),
                 Object.assign(document.createElement("pre"), { textContent: args }));
  return details;
}

function statsText(s) {
  const parts = [];
  if (s.completion_tokens !== undefined) parts.push(`${s.estimated ? "~" : ""}${s.completion_tokens} tokens`);
  if (s.tokens_per_s) parts.push(`${s.tokens_per_s.toFixed(1)} tokens/s`);
  if (s.ttft_ms !== undefined) parts.push(`first token ${Math.round(s.ttft_ms)} ms`);
  if (s.prompt_tokens !== undefined) parts.push(`prompt ${s.prompt_tokens} tokens`);
  if (s.stopped) parts.push("stopped");
  else if (s.finish_reason === "length") parts.push("cut at max tokens");
  if (s.continued) parts.push("continued");
  if (s.edited) parts.push("edited");
  return parts.join(" · ");
}

function actionsElement(node) {
  const bar = Object.assign(document.createElement("div"), { className: "actions" });
  const siblings = conv.nodes[node.parent].children;
  if (siblings.length > 1) {
    const i = siblings.indexOf(node.id);
    const go = (j) => { conv.nodes[node.parent].active = siblings[j]; conv.current = leafOf(conv, siblings[j]); saveConversation(); render(); };
    const prev = button("‹", "link prev", "Previous alternative", () => go(i - 1));
    const next = button("›", "link next", "Next alternative", () => go(i + 1));
    prev.disabled = i === 0; next.disabled = i === siblings.length - 1;
    const count = Object.assign(document.createElement("span"), { className: "siblings", textContent: `${i + 1}/${siblings.length}` });
    bar.append(prev, count, next);
  }
  if (node.role !== "error") bar.append(copyButton("link copy", "Copy the message", () => node.content));
  if (cutOff(node)) bar.append(button("Continue", "link continue", "Continue the answer", () => continueAnswer(node)));
  if (node.role !== "error") bar.append(button("Edit", "link edit", "Edit the message", () => editMessage(node)));
  if (node.role !== "user") bar.append(button("Regenerate", "link regenerate", "Regenerate the answer", () => regenerate(node)));
  return bar;
}

function editMessage(node) {
  if (streaming()) return;
  const div = $("log").querySelector(`[data-id="${node.id}"]`);
  const box = Object.assign(document.createElement("textarea"), { className: "edit-box", value: node.content });
  box.setAttribute("aria-label", "Edit the message");
  const bar = Object.assign(document.createElement("div"), { className: "actions" });
  const save = () => {
    if (node.role === "user") { // a new sibling: the old message and its answers stay reachable
      const edited = addNode(conv, node.parent, { role: "user", content: box.value, ...(node.images ? { images: node.images } : {}),
                                                   ...(node.files ? { files: node.files } : {}) });
      generate(edited.id);
    } else { // a new alternative too, with its own (no) stats: the answer it replaces stays reachable
      addNode(conv, node.parent, { role: "assistant", content: box.value, model: node.model, stats: { edited: true },
                                   ...(node.reasoning ? { reasoning: node.reasoning } : {}),
                                   ...(node.tools ? { tools: structuredClone(node.tools) } : {}) });
      saveConversation(); render();
    }
  };
  bar.append(button(node.role === "user" ? "Send" : "Save", "save-edit", "Save the edit", save),
             button("Cancel", "link cancel-edit", "Cancel the edit", render));
  box.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); save(); }
    if (e.key === "Escape") { e.stopPropagation(); render(); }
  });
  div.querySelector(".body").replaceWith(box);
  div.querySelector(".actions").replaceWith(bar);
  box.focus();
}

function regenerate(node) {
  if (streaming()) return;
  let parent = node.parent; // the user message this answers
  while (parent !== "root" && conv.nodes[parent].role !== "user") parent = conv.nodes[parent].parent;
  if (parent !== "root") generate(parent);
}

// An answer cut at max_tokens, stopped, or interrupted by a reload can be continued where it ended (the last
// message of its branch only: continuing one that has been answered would change what the answer replied to).
const cutOff = (node) => node.role === "assistant" && !node.children.length && !!splitThinking(node.content).answer.trim()
  && (node.stats?.finish_reason === "length" || !!node.stats?.stopped || !!node.interrupted);
function continueAnswer(node) {
  if (streaming() || !cutOff(node)) return;
  delete node.interrupted;
  stream(conv, node, apiMessages(conv, node.id), { continue_final_message: true, add_generation_prompt: false });
}

// ---- the API -----------------------------------------------------------------------------------------------------
function headers() {
  const h = { "Content-Type": "application/json" };
  if ($("api-key").value) h.Authorization = "Bearer " + $("api-key").value;
  return h;
}
async function errorText(response) {
  try { const body = await response.json(); return `${response.status}: ${body.error?.message ?? JSON.stringify(body)}`; }
  catch { return `${response.status} ${response.statusText}`; }
}
function showNotice(text, error = true) {
  const div = Object.assign(document.createElement("div"), { className: `msg notice${error ? " error" : ""}` });
  div.setAttribute("role", error ? "alert" : "status");
  div.append(Object.assign(document.createElement("div"), { className: "role", textContent: error ? "error" : "note" }),
             Object.assign(document.createElement("div"), { className: "body", textContent: text }));
  $("log").append(div);
}

// A message with images goes as OpenAI content parts: the images as data: URLs, then the text; attached files go
// as text before the message's own.
function apiContent(m) {
  const text = textWithFiles(m.content, m.files);
  if (!m.images?.length) return text;
  const parts = m.images.map((url) => ({ type: "image_url", image_url: { url } }));
  return text ? [...parts, { type: "text", text }] : parts;
}
function apiMessages(c, upTo) {
  const messages = [];
  if ($("system").value.trim()) messages.push({ role: "system", content: $("system").value.trim() });
  const path = pathOf(c, upTo);
  path.forEach((m, i) => { // a turn refused once (too long, say) is not sent again, nor its error
    if (m.role === "error" || failed(path, i)) return;
    if (m.role !== "assistant") { messages.push({ role: m.role, content: apiContent(m) }); return; }
    const answer = splitThinking(m.content).answer; // an interrupted answer goes as far as it got, an empty one not at all
    if (answer.trim()) messages.push({ role: "assistant", content: answer });
  });
  return messages;
}

const SAMPLING = [ // [field, request key, parse]; an empty field leaves the server's default
  ["top-p", "top_p", Number], ["top-k", "top_k", Number], ["min-p", "min_p", Number],
  ["repetition-penalty", "repetition_penalty", Number], ["presence-penalty", "presence_penalty", Number],
  ["frequency-penalty", "frequency_penalty", Number], ["seed", "seed", Number],
];
function requestBody(messages, extra) {
  const body = { model: $("model").value, messages, ...extra, stream: true, stream_options: { include_usage: true },
                 temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value) };
  for (const [id, key, parse] of SAMPLING) if ($(id).value.trim() !== "") body[key] = parse($(id).value);
  return body;
}

// Streams an answer to the message `parentId` into a new assistant node under it.
function generate(parentId) {
  const node = addNode(conv, parentId, { role: "assistant", content: "", model: $("model").value });
  return stream(conv, node, apiMessages(conv, parentId));
}

// Streams into `node` (empty, or an answer to continue: then `extra` asks the server to go on from its end), saved
// every 500 ms as it comes (`streaming` names this tab until it ends), in its conversation whichever one is open.
async function stream(c, node, messages, extra = {}) {
  const parentId = node.parent, before = node.stats;
  node.streaming = TAB;
  const controller = new AbortController();
  streams.set(c.id, { conv: c, controller });
  let saved = 0;
  const saveProgress = () => { saved = performance.now(); node.streamedAt = Date.now(); saveConversation(c); };
  saveProgress(); // the question survives a reload while the answer streams
  const saver = setInterval(saveProgress, 500);
  render();
  const started = performance.now();
  let first = null, chunks = 0, usage = null, pending = null, finishReason = null;
  const update = () => {
    pending = null;
    const old = conv === c && $("log").querySelector(`[data-id="${node.id}"]`);
    if (!old) return;
    const follow = nearBottom();
    old.replaceWith(messageElement(node, false));
    if (follow) $("log").scrollTop = $("log").scrollHeight;
  };
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal, body: JSON.stringify(requestBody(messages, extra)),
    });
    if (!response.ok) throw new Error(await errorText(response));
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut); buffer = buffer.slice(cut + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.replace(/^data: ?/, "")).join("\n");
        if (!data || data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        finishReason = chunk.choices?.[0]?.finish_reason ?? finishReason;
        const delta = chunk.choices?.[0]?.delta;
        if (!delta) continue;
        const reasoning = delta.reasoning_content ?? delta.reasoning;
        if (delta.content || reasoning || delta.tool_calls) { first ??= performance.now(); chunks += 1; }
        if (delta.content) node.content += delta.content;
        if (reasoning) node.reasoning = (node.reasoning ?? "") + reasoning;
        for (const call of delta.tool_calls ?? []) {
          node.tools ??= [];
          const index = call.index ?? node.tools.length;
          const slot = (node.tools[index] ??= { id: call.id, type: "function", function: { name: "", arguments: "" } });
          if (call.function?.name) slot.function.name += call.function.name;
          if (call.function?.arguments) slot.function.arguments += call.function.arguments;
        }
        pending ??= setTimeout(update, 40);
      }
      if (performance.now() - saved >= 500) saveProgress(); // timers are slowed in a hidden tab; tokens are not
    }
  } catch (e) {
    if (e.name !== "AbortError") {
      const partial = node.content || node.reasoning || node.tools;
      if (!partial) removeNode(c, node.id);
      addNode(c, partial ? node.id : parentId, { role: "error", content: e.message });
    }
  } finally {
    clearInterval(saver); clearTimeout(pending);
    delete node.streaming; delete node.streamedAt;
    streams.delete(c.id);
    const ended = performance.now();
    if (c.nodes[node.id]) {
      if (!node.content && !node.reasoning && !node.tools) removeNode(c, node.id); // stopped before a token
      else {
        const tokens = usage?.completion_tokens ?? chunks;
        // The decode rate after the first token; an answer that came in one burst is rated over the whole request.
        const decoding = first !== null && ended - first >= 50 && tokens > 1;
        const tokensPerS = decoding ? (tokens - 1) / ((ended - first) / 1000) : tokens / ((ended - started) / 1000);
        const continued = !!extra.continue_final_message; // a continued answer counts the tokens of every part
        node.stats = { completion_tokens: tokens + (continued ? before?.completion_tokens ?? 0 : 0),
                       prompt_tokens: usage?.prompt_tokens, estimated: !usage || (continued && !!before?.estimated),
                       ttft_ms: first !== null ? first - started : undefined, tokens_per_s: tokensPerS, stopped: !usage,
                       finish_reason: finishReason ?? undefined, continued: continued || undefined,
                       context_tokens: usage ? usage.prompt_tokens + usage.completion_tokens : undefined };
      }
    }
    saveConversation(c);
    if (conv === c) render();
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("log").setAttribute("aria-busy", String(busy));
}

function send() {
  const text = $("input").value.trim();
  if ((!text && !attachments.length) || streaming()) return;
  const images = attachments.filter((a) => a.kind === "image").map((a) => a.url);
  const files = attachments.filter((a) => a.kind === "file").map(({ name, text }) => ({ name, text }));
  const user = addNode(conv, conv.current, { role: "user", content: text, ...(images.length ? { images } : {}),
                                             ...(files.length ? { files } : {}) });
  const title = text || attachments.map((a) => a.name).join(", ");
  if (conv.title === "New conversation") conv.title = title.replace(/\s+/g, " ").slice(0, 60);
  $("input").value = ""; attachments = []; showAttachments();
  generate(user.id);
}

// ---- models, and what they take ----------------------------------------------------------------------------------
let cards = [];
async function loadModels() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (!r.ok) throw new Error(await errorText(r));
    cards = (await r.json()).data.filter((m) => !m.task || m.task === "generate");
    const select = $("model");
    select.innerHTML = "";
    for (const m of cards) select.append(Object.assign(document.createElement("option"), { value: m.id, textContent: m.id }));
    const saved = store.get("model", null);
    if (saved && cards.some((m) => m.id === saved)) select.value = saved;
    showCapabilities();
  } catch (e) { showNotice("Could not list models: " + e.message); }
}
// Images are taken unless the card says the model takes none (a card without capabilities, from another server,
// is taken at its word: it may).
const card = () => cards.find((m) => m.id === $("model").value);
const takesImages = () => card()?.capabilities?.vision !== false;
function showCapabilities() {
  const label = `Attach text, code or PDF files${takesImages() ? " or images" : ""} (or paste or drop them)`;
  $("attach-button").setAttribute("aria-label", label);
  $("attach-button").title = label;
  if (!takesImages() && attachments.some((a) => a.kind === "image")) {
    attachments = attachments.filter((a) => a.kind !== "image");
    showAttachments();
    showNotice(`The images were removed: ${$("model").value} does not take images`);
  }
  showContext();
}
$("model").addEventListener("change", () => { store.set("model", $("model").value); showCapabilities(); });
$("api-key").addEventListener("change", loadModels);

// How much of the model's context the open conversation fills: the prompt and answer of its last answered request
// (the stream's usage) against the card's max_model_len.
function showContext() {
  const gauge = $("context"), max = card()?.max_model_len;
  gauge.hidden = !max || !conv;
  if (gauge.hidden) return;
  const last = pathOf(conv).findLast((n) => n.stats?.context_tokens !== undefined);
  const used = last?.stats.context_tokens ?? 0, share = Math.min(used / max, 1);
  gauge.querySelector(".count").textContent = `${used} / ${max}`;
  gauge.querySelector(".gauge > span").style.width = `${(share * 100).toFixed(1)}%`;
  gauge.classList.toggle("full", share >= 0.9);
  gauge.title = `Context: ${used} of the model's ${max} tokens (${Math.round(share * 100)}%) as of the last answer`;
  for (const [name, value] of [["role", "meter"], ["aria-label", "Context used"], ["aria-valuemin", 0],
                               ["aria-valuemax", max], ["aria-valuenow", used], ["aria-valuetext", gauge.title]]) {
    gauge.setAttribute(name, value);
  }
}

// ---- attachments -------------------------------------------------------------------------------------------------
let attachments = []; // what goes with the next message: {kind: "image", name, url} or {kind: "file", name, text}
async function attach(files) {
  const options = { takesImages: takesImages(), model: $("model").value };
  for (const file of files) {
    try { attachments.push(await readAttachment(file, options)); }
    catch (e) { showNotice("Not attached: " + e.message); }
  }
  showAttachments();
}
function showAttachments() {
  const strip = $("attachments");
  strip.innerHTML = "";
  attachments.forEach((item, i) => {
    const remove = button("", "attachment", `Remove ${item.name}`, () => { attachments.splice(i, 1); showAttachments(); });
    if (item.kind === "image") remove.append(Object.assign(document.createElement("img"), { src: item.url, alt: "" }));
    else remove.append(item.name);
    remove.append(Object.assign(document.createElement("span"), { className: "remove", textContent: "✕" }));
    strip.append(remove);
  });
}
$("attach-button").addEventListener("click", () => $("attach").click());
$("attach").addEventListener("change", async (e) => { await attach([...e.target.files]); e.target.value = ""; });
$("input").addEventListener("paste", (e) => {
  const files = [...(e.clipboardData?.files ?? [])];
  if (files.length) { e.preventDefault(); attach(files); }
});
const main = document.querySelector("main");
main.addEventListener("dragover", (e) => {
  if (!e.dataTransfer?.types.includes("Files")) return;
  e.preventDefault();
  main.classList.add("dragging");
});
main.addEventListener("dragleave", () => main.classList.remove("dragging"));
main.addEventListener("drop", (e) => {
  main.classList.remove("dragging");
  const files = [...(e.dataTransfer?.files ?? [])];
  if (files.length) { e.preventDefault(); attach(files); }
});

// ---- settings and presets ----------------------------------------------------------------------------------------
const SETTINGS = ["system", "temperature", "max-tokens", "top-p", "top-k", "min-p", "repetition-penalty",
                  "presence-penalty", "frequency-penalty", "seed"];
const settingKey = (id) => id.replace(/-(\w)/g, (_, c) => c.toUpperCase()); // max-tokens -> maxTokens, as before
for (const id of [...SETTINGS, "api-key"]) {
  const saved = store.get(settingKey(id), null);
  if (saved !== null) $(id).value = saved;
  $(id).addEventListener("change", () => store.set(settingKey(id), $(id).value));
}
const showTemperature = () => { $("temperature-value").textContent = $("temperature").value; };
$("temperature").addEventListener("input", showTemperature);
showTemperature();

function renderPresets() {
  const select = $("preset"), presets = store.get("presets", {});
  select.length = 1;
  for (const name of Object.keys(presets).sort()) {
    select.append(Object.assign(document.createElement("option"), { value: name, textContent: name }));
  }
}
$("save-preset").addEventListener("click", () => {
  const name = $("preset-name").value.trim();
  if (!name) { $("preset-name").focus(); return; }
  store.set("presets", { ...store.get("presets", {}), [name]: Object.fromEntries(SETTINGS.map((id) => [id, $(id).value])) });
  renderPresets();
  $("preset").value = name;
});
$("preset").addEventListener("change", () => {
  const preset = store.get("presets", {})[$("preset").value];
  if (!preset) return;
  for (const id of SETTINGS) { $(id).value = preset[id] ?? ""; $(id).dispatchEvent(new Event("change")); }
  showTemperature();
});
$("delete-preset").addEventListener("click", () => {
  const presets = store.get("presets", {});
  delete presets[$("preset").value];
  store.set("presets", presets);
  renderPresets();
});
$("open-settings").addEventListener("click", () => $("settings").showModal());
renderPresets();

// ---- import and export -------------------------------------------------------------------------------------------
$("export").addEventListener("click", async () => {
  let stored;
  try { stored = new Map((await conversationStore.all()).map((c) => [c.id, c])); }
  catch (e) { showNotice("Could not export: " + e.message); return; }
  const all = conversations.map((e) => streams.get(e.id)?.conv ?? stored.get(e.id)).filter(Boolean);
  const file = new Blob([JSON.stringify({ format: "heteroserve-chat", version: 1, conversations: all }, null, 1)], { type: "application/json" });
  const a = Object.assign(document.createElement("a"), { href: URL.createObjectURL(file), download: "heteroserve-conversations.json" });
  a.click();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
});

$("import").addEventListener("click", () => $("import-file").click());
$("import-file").addEventListener("change", async (e) => {
  const file = e.target.files[0];
  e.target.value = "";
  if (!file) return;
  try { // a conversation already here (the same id) is skipped: importing a file twice adds nothing
    const imported = importedConversations(JSON.parse(await file.text())).filter((c) => !isEmpty(c));
    const now = Date.now();
    imported.forEach((c, i) => { c.updated = now - i; }); // listed in the file's order
    const added = new Set(await conversationStore.addMissing(imported));
    for (const c of imported.filter((c) => added.has(c.id))) {
      showInList(entryOf(c));
      channel.postMessage({ type: "saved", id: c.id });
    }
    renderList();
    const first = imported.find((c) => added.has(c.id));
    if (first) await openConversation(first.id);
    const skipped = imported.length - added.size;
    const plural = (n) => `${n} conversation${n === 1 ? "" : "s"}`;
    showNotice(`Imported ${plural(added.size)} from ${file.name}` + (skipped ? `; skipped ${plural(skipped)} already here.` : "."), false);
  } catch (err) { showNotice("Could not import " + file.name + ": " + err.message); }
});

// ---- layout, theme and keys --------------------------------------------------------------------------------------
const narrow = window.matchMedia("(max-width: 760px)");
function closeSidebarOnPhone() { if (narrow.matches) setSidebarOpen(false); }
function setSidebarOpen(open) {
  document.body.classList.toggle("sidebar-open", open);
  $("scrim").hidden = !open;
  $("toggle-sidebar").setAttribute("aria-expanded", String(open));
}
$("toggle-sidebar").addEventListener("click", () => {
  if (narrow.matches) setSidebarOpen(!document.body.classList.contains("sidebar-open"));
  else { document.body.classList.toggle("sidebar-hidden"); store.set("sidebarHidden", document.body.classList.contains("sidebar-hidden")); }
});
$("close-sidebar").addEventListener("click", () => setSidebarOpen(false));
function focusSearch() { // Ctrl+K: the list is shown first where it is folded away
  if (narrow.matches) setSidebarOpen(true);
  else if (document.body.classList.contains("sidebar-hidden")) { document.body.classList.remove("sidebar-hidden"); store.set("sidebarHidden", false); }
  $("search").focus();
  $("search").select();
}
$("scrim").addEventListener("click", () => setSidebarOpen(false));
document.body.classList.toggle("sidebar-hidden", store.get("sidebarHidden", false));

const THEMES = ["auto", "light", "dark"];
function applyTheme(theme) {
  if (theme === "auto") delete document.documentElement.dataset.theme; else document.documentElement.dataset.theme = theme;
  const label = `Theme: ${theme === "auto" ? "follows the system" : theme} (click to change)`;
  $("theme").setAttribute("aria-label", label);
  $("theme").title = label;
}
$("theme").addEventListener("click", () => {
  const theme = THEMES[(THEMES.indexOf(store.get("theme", "auto")) + 1) % THEMES.length];
  store.set("theme", theme);
  applyTheme(theme);
});
applyTheme(store.get("theme", "auto"));

$("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); $("composer").requestSubmit(); }
});
function stop() { // the answer streaming in the open conversation, in this tab or another
  if (streams.has(conv?.id)) streams.get(conv.id).controller.abort();
  else if (conv) channel.postMessage({ type: "stop", id: conv.id });
}
$("stop").addEventListener("click", stop);
$("new-chat").addEventListener("click", startConversation);
$("search").addEventListener("input", renderList);
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && streaming()) { e.preventDefault(); stop(); }
  else if (e.key === "Escape" && document.body.classList.contains("sidebar-open")) setSidebarOpen(false);
  else if ((e.ctrlKey || e.metaKey) && e.shiftKey && e.key.toLowerCase() === "o") { e.preventDefault(); startConversation(); }
  else if ((e.ctrlKey || e.metaKey) && !e.shiftKey && !e.altKey && e.key.toLowerCase() === "k") { e.preventDefault(); focusSearch(); }
});

// ---- start -------------------------------------------------------------------------------------------------------
(async function start() {
  try {
    await migrateLocalStorage(); // the conversations of the page before IndexedDB, once
    const legacy = store.get("history", null); // the single conversation of the page before conversation lists
    if (Array.isArray(legacy) && legacy.length) {
      await conversationStore.addMissing(importedConversations({ title: "Earlier conversation", messages: legacy }));
    }
    store.remove("history");
    conversations = (await conversationStore.all()).map(entryOf).sort((a, b) => b.updated - a.updated);
  } catch (e) { showNotice("Could not read the saved conversations: " + e.message); }
  // A reload reopens this tab's conversation; a new tab the one last opened in any.
  const current = [sessionStorage.getItem("heteroserve.current"), store.get("current", null)]
    .find((id) => conversations.some((e) => e.id === id));
  if (current) await openConversation(current); else openNewest();
  loadModels();
})();
