// Conversations in IndexedDB, one record each: a save writes its own conversation and never the list, so two tabs
// cannot overwrite each other's. Tabs tell each other what changed over a BroadcastChannel.

const DATABASE = "heteroserve", CONVERSATIONS = "conversations";
let opened = null;

function database() {
  opened ??= new Promise((resolve, reject) => {
    const request = indexedDB.open(DATABASE, 1);
    request.onupgradeneeded = () => request.result.createObjectStore(CONVERSATIONS, { keyPath: "id" });
    request.onsuccess = () => {
      const db = request.result;
      db.onversionchange = () => db.close(); // a newer page upgrades the schema: let it
      resolve(db);
    };
    request.onerror = () => reject(request.error);
  });
  return opened;
}

// Runs `work(store)` in one transaction; resolves, once it is committed, to what `work` returned (a request's result).
async function transaction(mode, work) {
  const db = await database();
  return new Promise((resolve, reject) => {
    const tx = db.transaction(CONVERSATIONS, mode);
    const out = work(tx.objectStore(CONVERSATIONS));
    tx.oncomplete = () => resolve(out instanceof IDBRequest ? out.result : out);
    tx.onerror = tx.onabort = () => reject(tx.error ?? new Error("the transaction was aborted"));
  });
}

export const conversationStore = {
  all: () => transaction("readonly", (s) => s.getAll()),
  get: (id) => transaction("readonly", (s) => s.get(id)),
  put: (conv) => transaction("readwrite", (s) => s.put(conv)),
  remove: (id) => transaction("readwrite", (s) => s.delete(id)),
  // Adds the conversations whose id is not stored yet, in one transaction; resolves to the ids added.
  addMissing: (convs) => transaction("readwrite", (s) => {
    const added = [];
    for (const conv of convs) {
      const request = s.add(conv);
      request.onsuccess = () => added.push(conv.id);
      request.onerror = (e) => { e.preventDefault(); e.stopPropagation(); }; // already there: keep the transaction
    }
    return added;
  }),
};

// Moves the conversations of the page's localStorage days (the index and one key per conversation, orphans
// included) into IndexedDB once, then removes them; a conversation already in IndexedDB is not overwritten.
export async function migrateLocalStorage() {
  const prefix = "heteroserve.conversation.";
  const keys = [];
  for (let i = 0; i < localStorage.length; i++) if (localStorage.key(i).startsWith(prefix)) keys.push(localStorage.key(i));
  const convs = [];
  for (const key of keys) {
    try {
      const conv = JSON.parse(localStorage.getItem(key));
      if (conv?.id && conv.nodes?.root) convs.push(conv);
    } catch { /* unreadable: nothing to keep */ }
  }
  if (convs.length) await conversationStore.addMissing(convs);
  for (const key of keys) localStorage.removeItem(key);
  localStorage.removeItem("heteroserve.conversations");
  return convs.length;
}

// Messages between the page's tabs: {type: "saved" | "deleted", id} and {type: "gone", tab}.
export const channel = typeof BroadcastChannel === "function"
  ? new BroadcastChannel("heteroserve.conversations")
  : { postMessage() {}, addEventListener() {} };

// This tab's id, and which tabs are open now: held Web Locks where the browser has them (a secure context),
// else null (the caller then judges by how recently an answer was saved).
export const TAB = Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
const LOCK = "heteroserve.tab.";
navigator.locks?.request(LOCK + TAB, () => new Promise(() => {})); // held until the tab closes or reloads
export async function openTabs() {
  if (!navigator.locks) return null;
  const { held } = await navigator.locks.query();
  return new Set(held.filter((l) => l.name.startsWith(LOCK)).map((l) => l.name.slice(LOCK.length)));
}
