// Files attached to a message. An image goes as an image part (when the model takes images); a text or code file,
// or the text of a PDF, is read here in the browser and goes as text with its file name. Anything else is refused
// with a reason the page shows, never dropped without a word.

const MAX_TEXT_CHARS = 500_000; // far beyond any context; a file this long is refused rather than cut
const PDF_TYPES = ["application/pdf", "application/x-pdf"];

// Resolves to {kind: "image", name, url} or {kind: "file", name, text}; rejects with an Error that says why not.
export async function readAttachment(file, { takesImages, model }) {
  if (file.type.startsWith("image/")) {
    if (!takesImages) throw new Error(`${file.name}: ${model} does not take images`);
    return { kind: "image", name: file.name, url: await dataURL(file) };
  }
  const bytes = new Uint8Array(await file.arrayBuffer());
  const text = isPdf(file, bytes) ? await pdfText(file.name, bytes) : plainText(file.name, bytes);
  if (text.length > MAX_TEXT_CHARS) throw new Error(`${file.name} is too long to send (${text.length} characters)`);
  return { kind: "file", name: file.name, text };
}

const isPdf = (file, bytes) =>
  PDF_TYPES.includes(file.type) || /\.pdf$/i.test(file.name) || new TextDecoder().decode(bytes.slice(0, 5)) === "%PDF-";

// Text is UTF-8 without NUL bytes (UTF-16 files, images under another name and executables all fail one test).
function plainText(name, bytes) {
  if (bytes.includes(0)) throw new Error(`${name} is not a text, code, PDF or image file`);
  try { return new TextDecoder("utf-8", { fatal: true, ignoreBOM: false }).decode(bytes); }
  catch { throw new Error(`${name} is not a text, code, PDF or image file (it is not UTF-8 text)`); }
}

// PDF.js (about 1.7 MB) is imported the first time a PDF is attached, not before.
let pdfjs = null;
function loadPdfjs() {
  pdfjs ??= import("./vendor/pdfjs/pdf.min.mjs").then((lib) => {
    lib.GlobalWorkerOptions.workerSrc = new URL("./vendor/pdfjs/pdf.worker.min.mjs", import.meta.url).href;
    return lib;
  }).catch((e) => { pdfjs = null; throw e; });
  return pdfjs;
}
async function pdfText(name, bytes) {
  const lib = await loadPdfjs();
  const task = lib.getDocument({ data: bytes, isEvalSupported: false });
  let doc;
  try { doc = await task.promise; }
  catch (e) { task.destroy(); throw new Error(`${name} could not be read as a PDF: ${e.message}`); }
  try {
    const pages = [];
    for (let n = 1; n <= doc.numPages; n++) {
      const content = await (await doc.getPage(n)).getTextContent();
      pages.push(content.items.map((item) => (item.str ?? "") + (item.hasEOL ? "\n" : "")).join("").trim());
    }
    const text = pages.join("\n\n").trim();
    if (!text) throw new Error(`${name} has no text to read (a scanned PDF?)`);
    return text;
  } finally { task.destroy(); }
}

function dataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

// What the model reads for a message with files: each file's name and text in a fence longer than any run of
// backticks inside it, then the message.
export function textWithFiles(content, files = []) {
  const blocks = files.map(({ name, text }) => {
    const longest = Math.max(0, ...(text.match(/`+/g) ?? []).map((run) => run.length));
    const fence = "`".repeat(Math.max(3, longest + 1));
    return `${name}:\n${fence}\n${text}\n${fence}`;
  });
  return [...blocks, content].filter(Boolean).join("\n\n");
}
