// A safe subset of Markdown, rendered by building DOM nodes.
//
// Invariant: model text only ever reaches the page through textContent or
// document.createTextNode. Nothing here parses HTML, so `<img onerror=...>` or `<script>`
// in a reply is shown as the characters it is. The subset: paragraphs, headings, fenced
// code blocks (monospace, with a copy button), inline code, bold, italics, and bulleted
// or numbered lists, nested by indentation. An unclosed fence (a reply still streaming)
// renders as a code block.

// A fence: three or more backticks or tildes, then an info string whose first word names
// the language (```js title="a.js"); it closes at a line of the same character, at least as
// many of them and nothing else (CommonMark's rule), so ```` can hold a ``` example.
const FENCE = /^\s*(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
const closesFence = (line, fence) => {
  const t = line.trim();
  return t.length >= fence.length && t === fence[0].repeat(t.length);
};
const ITEM = /^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
// Inline spans, in order of precedence: `code`, **bold**, __bold__, *italic*, _italic_.
const INLINE = /`([^`\n]+)`|\*\*(?=\S)(.+?)\*\*|__(?=\S)(.+?)__|\*(?=[^\s*])((?:[^*]*?[^\s*])?)\*|(?<![\p{L}\p{N}_])_(?=[^\s_])((?:[^_]*?[^\s_])?)_(?![\p{L}\p{N}_])/gu;

function el(tag, className) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  return node;
}

// The inline spans of `text`, appended to `parent`.
export function renderInline(text, parent) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) parent.appendChild(document.createTextNode(text.slice(last, m.index)));
    if (m[1] !== undefined) {
      const code = el("code");
      code.textContent = m[1];
      parent.appendChild(code);
    } else if (m[2] !== undefined || m[3] !== undefined) {
      renderInline(m[2] ?? m[3], parent.appendChild(el("strong")));
    } else {
      renderInline(m[4] ?? m[5], parent.appendChild(el("em")));
    }
    last = m.index + m[0].length;
  }
  if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
}

function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) return navigator.clipboard.writeText(text);
  // Plain http on another host: no Clipboard API, so select a hidden textarea and copy it.
  const area = el("textarea", "offscreen");
  area.value = text;
  document.body.appendChild(area);
  area.select();
  const ok = document.execCommand("copy");
  area.remove();
  return ok ? Promise.resolve() : Promise.reject(new Error("copy refused"));
}

function codeBlock(lang, code) {
  const block = el("div", "code-block");
  const head = block.appendChild(el("div", "code-head"));
  head.appendChild(el("span", "code-lang")).textContent = lang;
  const button = head.appendChild(el("button", "copy"));
  button.type = "button";
  button.textContent = "Copy";
  button.addEventListener("click", () => {
    copyText(code).then(() => { button.textContent = "Copied"; },
                        () => { button.textContent = "Copy failed"; });
    setTimeout(() => { button.textContent = "Copy"; }, 1500);
  });
  block.appendChild(el("pre")).appendChild(el("code")).textContent = code;
  return block;
}

function paragraph(lines) {
  const p = el("p");
  lines.forEach((line, i) => {
    if (i > 0) p.appendChild(el("br"));
    renderInline(line, p);
  });
  return p;
}

// A list item (ITEM's match, its line indented by `indent` spaces) into the open `lists`:
// indented two or more past the innermost list's items, it opens a list inside the last
// item; less indented, it closes lists until one is at its depth.
function addItem(lists, out, item, indent) {
  while (lists.length && indent < lists[lists.length - 1].indent) lists.pop();
  const ordered = /\d/.test(item[1]);
  let top = lists[lists.length - 1];
  if (top && indent >= top.indent + 2) {
    top = null;
  } else if (top && top.ordered !== ordered) {
    lists.pop();
    top = null;
  }
  if (!top) {
    const parent = lists.length ? lists[lists.length - 1].node.lastChild : out;
    top = { node: parent.appendChild(el(ordered ? "ol" : "ul")), ordered, indent };
    if (ordered && parseInt(item[1], 10) !== 1) top.node.start = parseInt(item[1], 10);
    lists.push(top);
  }
  renderInline(item[2], top.node.appendChild(el("li")));
}

// `text` as a DocumentFragment of block elements.
export function renderMarkdown(text) {
  const out = document.createDocumentFragment();
  const lines = text.replace(/\r\n?/g, "\n").split("\n");
  let para = [];
  let lists = []; // the open lists, outermost first: {node, ordered, indent}
  const flush = () => {
    if (para.length) out.appendChild(paragraph(para));
    para = [];
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    if (fence) {
      flush();
      lists = [];
      const body = [];
      for (i++; i < lines.length && !closesFence(lines[i], fence[1]); i++) body.push(lines[i]);
      out.appendChild(codeBlock(fence[2], body.join("\n")));
      continue;
    }
    const item = ITEM.exec(line);
    if (item) {
      flush();
      addItem(lists, out, item, /^\s*/.exec(line)[0].replace(/\t/g, "    ").length);
      continue;
    }
    if (lists.length && /^\s{2,}\S/.test(line)) { // an indented line continues the list item
      const li = lists[lists.length - 1].node.lastChild;
      li.appendChild(el("br"));
      renderInline(line.trim(), li);
      continue;
    }
    lists = [];
    const heading = HEADING.exec(line);
    if (heading) {
      flush();
      renderInline(heading[2], out.appendChild(el(`h${Math.min(heading[1].length + 2, 6)}`)));
    } else if (line.trim() === "") {
      flush();
    } else {
      para.push(line);
    }
  }
  flush();
  return out;
}

// How much of `text` nothing appended to it can render differently: up to the last blank
// line outside a code fence (a blank line ends every block and resets the lists).
export function settledLength(text) {
  let settled = 0;
  let fence = null;
  for (let start = 0, end = text.indexOf("\n"); end !== -1; start = end + 1, end = text.indexOf("\n", start)) {
    const line = text.slice(start, end);
    if (fence) {
      if (closesFence(line, fence)) fence = null;
    } else if (FENCE.test(line)) {
      fence = FENCE.exec(line)[1];
    } else if (line.trim() === "") {
      settled = end + 1;
    }
  }
  return settled;
}

const settledNodes = new WeakMap(); // element -> {length, count}: text rendered once, as its first nodes

// Render `text`, a reply still growing, into `parent`: what settledLength says is settled is
// rendered once and kept, only the rest again (a long reply would otherwise be rebuilt on
// every frame, its cost growing with the square of its length).
export function renderGrowing(parent, text) {
  let done = settledNodes.get(parent);
  if (!done || text.length < done.length || parent.childNodes.length < done.count) {
    parent.replaceChildren();
    done = { length: 0, count: 0 };
  }
  while (parent.childNodes.length > done.count) parent.lastChild.remove();
  const upTo = settledLength(text);
  if (upTo > done.length) {
    parent.appendChild(renderMarkdown(text.slice(done.length, upTo)));
    done = { length: upTo, count: parent.childNodes.length };
  }
  settledNodes.set(parent, done);
  parent.appendChild(renderMarkdown(text.slice(done.length)));
}

// Render `text` whole into `parent` (forgetting what renderGrowing kept).
export function renderAll(parent, text) {
  settledNodes.delete(parent);
  parent.replaceChildren(renderMarkdown(text));
}
