// Conversations as trees: a message's children are its alternatives (edits of a question, regenerated answers),
// `active` is the child on the path shown, `current` the last message of that path. The conversations are kept in
// IndexedDB (storage.js); `store` keeps the page's settings in localStorage.
export const store = {
  get(key, fallback) {
    try { return JSON.parse(localStorage.getItem("heteroserve." + key)) ?? fallback; } catch { return fallback; }
  },
  set(key, value) { localStorage.setItem("heteroserve." + key, JSON.stringify(value)); },
  remove(key) { localStorage.removeItem("heteroserve." + key); },
};

export const newId = () => Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
export function newConversation() {
  const now = Date.now();
  return { id: newId(), title: "New conversation", created: now, updated: now,
           nodes: { root: { id: "root", children: [], active: null } }, current: "root" };
}
export function addNode(conv, parentId, fields) {
  const node = { id: newId(), parent: parentId, children: [], active: null, ...fields };
  conv.nodes[node.id] = node;
  conv.nodes[parentId].children.push(node.id);
  conv.nodes[parentId].active = node.id;
  conv.current = node.id;
  return node;
}
export function removeNode(conv, id) {
  const node = conv.nodes[id], parent = conv.nodes[node.parent];
  parent.children = parent.children.filter((c) => c !== id);
  parent.active = parent.children.at(-1) ?? null;
  delete conv.nodes[id];
  conv.current = leafOf(conv, node.parent);
}
export function leafOf(conv, id) {
  while (conv.nodes[id].children.length) id = conv.nodes[id].active ?? conv.nodes[id].children.at(-1);
  return id;
}
export function pathOf(conv, id = conv.current) {
  const path = [];
  for (; id && id !== "root"; id = conv.nodes[id].parent) path.unshift(conv.nodes[id]);
  return path;
}
// A question refused (too long, say) is shown dimmed and never sent again, nor its error.
export const failed = (path, i) => path[i].role === "user" && path[i + 1]?.role === "error";
export const isEmpty = (conv) => conv.nodes.root.children.length === 0;

// Takes our export, one exported conversation, or a plain {title, messages: [{role, content}]} (OpenAI's shape).
// A conversation keeps its id, so importing it again can be recognised.
export function importedConversations(data) {
  const items = Array.isArray(data) ? data : Array.isArray(data?.conversations) ? data.conversations : [data];
  return items.map((item) => {
    const c = newConversation();
    if (typeof item?.id === "string" && item.id) c.id = item.id.slice(0, 64);
    c.title = String(item?.title ?? "Imported conversation").slice(0, 120);
    if (item?.nodes?.root) {
      const walk = (from, to) => {
        for (const id of item.nodes[from]?.children ?? []) {
          const n = item.nodes[id];
          if (!n) continue;
          addNode(c, to, cleanMessage(n));
          walk(id, c.current);
        }
      };
      walk("root", "root");
      c.current = leafOf(c, "root");
    } else if (Array.isArray(item?.messages)) {
      for (const m of item.messages) if (m?.role !== "system") addNode(c, c.current, cleanMessage(m));
    } else throw new Error("not a conversation: expected nodes or messages");
    return c;
  });
}
function cleanMessage(m) {
  const role = ["user", "assistant", "error"].includes(m.role) ? m.role : "user";
  let content = m.content ?? "", images = [...(m.images ?? [])];
  if (Array.isArray(content)) {
    images.push(...content.filter((p) => p?.type === "image_url").map((p) => p.image_url?.url));
    content = content.filter((p) => p?.type === "text").map((p) => p.text).join("\n");
  }
  const out = { role, content: String(content) };
  images = images.filter((u) => typeof u === "string" && u.startsWith("data:image/"));
  if (images.length) out.images = images;
  const files = (Array.isArray(m.files) ? m.files : []).filter((f) => typeof f?.text === "string")
    .map((f) => ({ name: String(f.name ?? "file"), text: f.text }));
  if (files.length) out.files = files;
  const reasoning = m.reasoning ?? m.reasoning_content;
  if (typeof reasoning === "string" && reasoning) out.reasoning = reasoning;
  const tools = m.tools ?? m.tool_calls;
  if (Array.isArray(tools)) {
    out.tools = tools.map((t) => ({
      function: { name: String(t?.function?.name ?? ""), arguments: String(t?.function?.arguments ?? "") },
    }));
  }
  if (m.stats && typeof m.stats === "object") out.stats = m.stats;
  if (m.interrupted || m.streaming) out.interrupted = true; // exported while it streamed
  return out;
}
