// Model output to safe HTML: markdown-it (CommonMark + GFM tables, linkify) with highlight.js for code and KaTeX
// for math, then DOMPurify, always. Raw HTML in the text is shown as text.
const { MarkdownIt, DOMPurify, hljs, katex } = window.heteroserveVendor;

export function escapeHtml(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}
function tex(source, displayMode) {
  try { return katex.renderToString(source, { displayMode, throwOnError: false, output: "htmlAndMathml" }); }
  catch { return escapeHtml(source); }
}

// Math as models write it: $...$ and \(...\) inline, $$...$$ and \[...\] as blocks. A "$" opens math only when a
// non-space follows it and closes only after a non-space not followed by a digit, so "$5 and $10" stays text.
function mathInline(state, silent) {
  const src = state.src, pos = state.pos;
  let open, close;
  if (src.startsWith("\\(", pos)) [open, close] = ["\\(", "\\)"];
  else if (src.startsWith("$$", pos)) [open, close] = ["$$", "$$"];
  else if (src[pos] === "$") [open, close] = ["$", "$"];
  else return false;
  const start = pos + open.length;
  let end = src.indexOf(close, start);
  if (open === "$") {
    if (/\s/.test(src[start] ?? " ")) return false;
    while (end !== -1 && (/\s/.test(src[end - 1]) || src[end - 1] === "\\")) end = src.indexOf("$", end + 1);
    if (end !== -1 && /\d/.test(src[end + 1] ?? "")) return false;
  }
  if (end === -1 || end === start) return false;
  if (!silent) {
    const token = state.push("math_inline", "math", 0);
    token.content = src.slice(start, end);
    token.markup = open;
  }
  state.pos = end + close.length;
  return true;
}
function mathBlock(state, startLine, endLine, silent) {
  if (state.sCount[startLine] - state.blkIndent >= 4) return false;
  const lineAt = (n) => state.src.slice(state.bMarks[n] + state.tShift[n], state.eMarks[n]);
  const first = lineAt(startLine);
  const close = first.startsWith("$$") ? "$$" : first.startsWith("\\[") ? "\\]" : null;
  if (!close) return false;
  const closing = (s) => (s.trimEnd().endsWith(close) ? s.trimEnd().slice(0, -close.length) : null);
  const lines = [];
  let line = startLine;
  const rest = first.slice(2);
  if (rest.trim().length > close.length && closing(rest) !== null) lines.push(closing(rest));
  else {
    lines.push(rest);
    for (line = startLine + 1; line < endLine; line++) {
      const text = lineAt(line), end = closing(text);
      if (end !== null) { lines.push(end); break; }
      lines.push(text);
    }
    if (line >= endLine) return false; // not closed (yet, while streaming): shown as text
  }
  if (silent) return true;
  const token = state.push("math_block", "math", 0);
  token.block = true;
  token.content = lines.join("\n");
  token.map = [startLine, line + 1];
  state.line = line + 1;
  return true;
}

const md = new MarkdownIt({
  html: false, // raw HTML in model output is shown as text; DOMPurify is the second line of defence
  linkify: true,
  highlight(code, language) {
    if (language && hljs.getLanguage(language)) {
      try { return hljs.highlight(code, { language, ignoreIllegals: true }).value; } catch { /* plain below */ }
    }
    return "";
  },
});
md.inline.ruler.before("escape", "math_inline", mathInline);
md.block.ruler.before("fence", "math_block", mathBlock, { alt: ["paragraph", "reference", "blockquote", "list"] });
md.renderer.rules.math_inline = (tokens, i) => tex(tokens[i].content, false);
md.renderer.rules.math_block = (tokens, i) => `<div class="math">${tex(tokens[i].content, true)}</div>`;

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") { node.setAttribute("target", "_blank"); node.setAttribute("rel", "noopener noreferrer"); }
});

export function toSafeHtml(text) {
  return DOMPurify.sanitize(md.render(text));
}

// A reasoning model's answer may carry its thinking inline, in <think>...</think> (or with only the closing tag
// when the chat template opened it).
export function splitThinking(content) {
  const open = content.match(/^\s*<think>([\s\S]*?)(?:<\/think>([\s\S]*)|$)/);
  if (open) return { thinking: open[1], answer: open[2] ?? "", thinkingDone: open[2] !== undefined };
  const cut = content.indexOf("</think>");
  if (cut >= 0) return { thinking: content.slice(0, cut), answer: content.slice(cut + 8), thinkingDone: true };
  return { thinking: "", answer: content, thinkingDone: true };
}

