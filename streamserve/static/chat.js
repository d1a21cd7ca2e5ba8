// The chat page: conversations in localStorage, replies streamed over the /v1/ws websocket.
//
// Protocol (streamserve/server/websocket.py): one socket, JSON text frames. A reply is a
// {"type": "request", "endpoint": "chat.completions"} frame answered by "chunk" frames and
// one "done" ("cancelled": true after a "cancel"), or by an "error" frame. With --api-key,
// the key goes in the socket's first frame, {"type": "auth", "api_key": ...}, and in an
// Authorization header on GET v1/models: never in a URL. It is kept in sessionStorage.
//
// State that must stay true: at most one reply streams at a time (state.reply); its
// message object is the one in its chat's `messages`, so deleting or switching chats
// while it streams neither loses it nor writes it into another chat.

import { renderAll, renderGrowing } from "./markdown.js";

const CHATS_KEY = "streamserve.chats";
const CURRENT_KEY = "streamserve.current";
const SETTINGS_KEY = "streamserve.settings";
const API_KEY_KEY = "streamserve.apiKey"; // sessionStorage
// model: the id chosen among GET v1/models' (the model or one of its LoRA adapters); "" the first
const DEFAULT_SETTINGS = { system: "", temperature: "0.7", top_p: "1", max_tokens: "", model: "" };
const MAX_BACKOFF_MS = 15000;

const $ = (id) => document.getElementById(id);
const ui = {
  app: $("app"), sidebar: $("sidebar"), backdrop: $("backdrop"), chatList: $("chat-list"),
  newChat: $("new-chat"), toggleSidebar: $("toggle-sidebar"), modelName: $("model-name"),
  status: $("status"), toggleSettings: $("toggle-settings"), settings: $("settings"),
  system: $("system-prompt"), temperature: $("temperature"), topP: $("top-p"),
  maxTokens: $("max-tokens"), settingsModel: $("settings-model"), maxModelLen: $("max-model-len"),
  modelChoice: $("model-choice"), modelSelect: $("model-select"),
  messages: $("messages"), composer: $("composer"), input: $("input"), send: $("send"),
  stop: $("stop"), keyDialog: $("key-dialog"), keyForm: $("key-form"),
  keyMessage: $("key-message"), keyInput: $("api-key"),
};

const state = {
  chats: loadJSON(CHATS_KEY, []),
  currentId: localStorage.getItem(CURRENT_KEY),
  settings: { ...DEFAULT_SETTINGS, ...loadJSON(SETTINGS_KEY, {}) },
  model: null, // {id, max_model_len, parent} from GET v1/models: the one replies come from
  models: [], // all of them: the model, then its LoRA adapters
  socket: null,
  connected: false,
  needsKey: false,
  attempt: 0, // reconnect attempts since the last good connection
  retryTimer: null,
  reply: null, // the streaming reply, see startReply
};
const elements = new WeakMap(); // message object -> its element on the page

function loadJSON(key, fallback) {
  try {
    const value = JSON.parse(localStorage.getItem(key));
    return value ?? fallback;
  } catch {
    return fallback;
  }
}

function saveChats() {
  try {
    localStorage.setItem(CHATS_KEY, JSON.stringify(state.chats));
    if (state.currentId) localStorage.setItem(CURRENT_KEY, state.currentId);
    else localStorage.removeItem(CURRENT_KEY);
  } catch (exc) {
    notice(`Could not save the conversations in this browser: ${exc.message}`);
  }
}

const newId = () => Date.now().toString(36) + Math.random().toString(36).slice(2, 10);
const currentChat = () => state.chats.find((c) => c.id === state.currentId) ?? null;

// ---- The sidebar ---------------------------------------------------------------------

function renderSidebar() {
  const items = [...state.chats].sort((a, b) => b.updated - a.updated).map((chat) => {
    const li = document.createElement("li");
    li.dataset.id = chat.id;
    if (chat.id === state.currentId) li.className = "current";
    const open = li.appendChild(document.createElement("button"));
    open.type = "button";
    open.className = "open";
    open.textContent = chat.title;
    open.title = chat.title;
    open.addEventListener("click", () => openChat(chat.id));
    const del = li.appendChild(document.createElement("button"));
    del.type = "button";
    del.className = "delete";
    del.textContent = "\u00d7";
    del.setAttribute("aria-label", `Delete conversation: ${chat.title}`);
    del.addEventListener("click", () => deleteChat(chat.id));
    return li;
  });
  ui.chatList.replaceChildren(...items);
}

function openChat(id) {
  state.currentId = id;
  saveChats();
  renderSidebar();
  renderChat();
  showSidebar(false);
}

function deleteChat(id) {
  if (state.reply && state.reply.chat.id === id) {
    cancelReply();
    finishReply(state.reply, "cancelled");
  }
  state.chats = state.chats.filter((c) => c.id !== id);
  if (state.currentId === id) state.currentId = null;
  saveChats();
  renderSidebar();
  renderChat();
}

function showSidebar(open) {
  ui.app.classList.toggle("sidebar-open", open);
  ui.backdrop.hidden = !open;
  ui.toggleSidebar.setAttribute("aria-expanded", String(open));
}

// ---- The conversation ----------------------------------------------------------------

function nearBottom() {
  const m = ui.messages;
  return m.scrollHeight - m.scrollTop - m.clientHeight < 80;
}

function renderChat() {
  const chat = currentChat();
  const nodes = chat ? chat.messages.map(messageElement) : [];
  if (!nodes.length) {
    const empty = document.createElement("p");
    empty.className = "empty";
    empty.textContent = `Ask ${state.model ? state.model.id : "the model"} anything. `
                        + "Enter sends; Shift+Enter starts a new line.";
    nodes.push(empty);
  }
  ui.messages.replaceChildren(...nodes);
  ui.messages.scrollTop = ui.messages.scrollHeight;
}

function messageElement(msg) {
  const node = document.createElement("div");
  node.className = `message ${msg.role}`;
  node.appendChild(document.createElement("div")).className = "body";
  elements.set(msg, node);
  updateMessage(msg);
  return node;
}

function updateMessage(msg) {
  const node = elements.get(msg);
  if (!node) return;
  const stick = node.isConnected && nearBottom();
  const body = node.querySelector(".body");
  if (msg.reasoning) showReasoning(node, msg);
  if (msg.role !== "assistant") body.textContent = msg.content;
  else if (state.reply?.msg === msg) renderGrowing(body, msg.content);
  else renderAll(body, msg.content);
  node.classList.toggle("streaming", state.reply?.msg === msg);
  node.querySelector(".stats")?.remove();
  node.querySelector(".error")?.remove();
  if (msg.error) {
    const error = node.appendChild(document.createElement("div"));
    error.className = "error";
    error.setAttribute("role", "alert");
    error.textContent = msg.error;
  }
  if (msg.stats) node.appendChild(statsElement(msg.stats));
  if (stick) ui.messages.scrollTop = ui.messages.scrollHeight;
}

// A reply's reasoning (the server's --reasoning-parser): plain text in a disclosure above
// the reply, open while the model thinks and closed once its answer begins.
function showReasoning(node, msg) {
  let details = node.querySelector(".reasoning");
  if (!details) {
    details = node.insertBefore(document.createElement("details"), node.querySelector(".body"));
    details.className = "reasoning";
    details.appendChild(document.createElement("summary")).textContent = "Thinking";
    details.appendChild(document.createElement("div")).className = "thought";
    details.open = state.reply?.msg === msg && !msg.content;
  } else if (details.open && msg.content && !details.dataset.touched) {
    details.open = false; // the answer began: the thinking folds away (unless opened by hand)
  }
  details.querySelector(".thought").textContent = msg.reasoning;
  details.querySelector("summary").textContent =
    state.reply?.msg === msg && !msg.content ? "Thinking\u2026" : "Thinking";
  details.onclick = () => { details.dataset.touched = "1"; };
}

function statsElement(stats) {
  const div = document.createElement("div");
  div.className = "stats";
  const parts = [
    ["ttft", stats.ttft == null ? "TTFT \u2013" : `TTFT ${stats.ttft.toFixed(2)} s`],
    ["rate", stats.tps == null ? "\u2013 tok/s" : `${stats.tps.toFixed(1)} tok/s`],
    ["tokens", `${stats.tokens} token${stats.tokens === 1 ? "" : "s"}`],
    ["finish", stats.finish ?? "unfinished"],
  ];
  for (const [name, text] of parts) {
    const span = div.appendChild(document.createElement("span"));
    span.className = name;
    span.textContent = text;
  }
  return div;
}

// A line in the conversation that belongs to no reply (a server error without an id).
function notice(text) {
  const p = document.createElement("p");
  p.className = "notice error";
  p.setAttribute("role", "alert");
  p.textContent = text;
  ui.messages.appendChild(p);
  ui.messages.scrollTop = ui.messages.scrollHeight;
}

// ---- Settings ------------------------------------------------------------------------

const SETTING_INPUTS = [["system", "system"], ["temperature", "temperature"], ["top_p", "topP"],
                        ["max_tokens", "maxTokens"]];

function loadSettings() {
  for (const [name, key] of SETTING_INPUTS) {
    ui[key].value = state.settings[name];
    ui[key].addEventListener("input", () => {
      state.settings[name] = ui[key].value;
      localStorage.setItem(SETTINGS_KEY, JSON.stringify(state.settings));
    });
  }
}

// The request body: the system prompt, the chat's turns (less those whose reply failed
// before any text), and the sampling settings that are set (a blank max tokens lets the
// server fill the context).
function requestBody(chat, upTo) {
  const messages = [];
  if (state.settings.system.trim()) messages.push({ role: "system", content: state.settings.system });
  const turns = chat.messages.slice(0, upTo);
  const failed = (m) => m?.role === "assistant" && !m.content && m.error;
  turns.forEach((m, i) => {
    if (m.content && !(m.role === "user" && failed(turns[i + 1]))) {
      messages.push({ role: m.role, content: m.content });
    }
  });
  const body = { messages, stream_options: { include_usage: true } };
  const number = (text) => (text.trim() === "" ? null : Number(text));
  const temperature = number(state.settings.temperature);
  const topP = number(state.settings.top_p);
  const maxTokens = number(state.settings.max_tokens);
  if (temperature !== null) body.temperature = temperature;
  if (topP !== null) body.top_p = topP;
  if (maxTokens !== null) body.max_tokens = maxTokens;
  if (state.model && state.model !== state.models[0]) body.model = state.model.id; // an adapter
  return body;
}

// ---- Sending and streaming -----------------------------------------------------------

function updateControls() {
  ui.send.disabled = !state.connected || state.reply !== null;
  ui.stop.hidden = state.reply === null;
  ui.stop.disabled = state.reply?.cancelRequested ?? false;
}

function send() {
  const text = ui.input.value;
  if (!text.trim() || state.reply || !state.connected) return;
  let chat = currentChat();
  if (!chat) {
    const title = text.trim().replace(/\s+/g, " ").slice(0, 60);
    chat = { id: newId(), title, updated: Date.now(), messages: [] };
    state.chats.push(chat);
    state.currentId = chat.id;
  }
  chat.messages.push({ role: "user", content: text });
  const msg = { role: "assistant", content: "", stats: null, error: null };
  chat.messages.push(msg);
  chat.updated = Date.now();
  ui.input.value = "";
  autosize();
  startReply(chat, msg);
  saveChats();
  renderSidebar();
  renderChat();
}

function startReply(chat, msg) {
  const id = newId();
  state.reply = {
    id, chat, msg,
    start: performance.now(), first: null, last: null, // first and last token's times
    chunks: 0, usage: null, finish: null, cancelRequested: false, renderQueued: false,
  };
  state.socket.send(JSON.stringify({ type: "request", id, endpoint: "chat.completions",
                                     body: requestBody(chat, chat.messages.length - 1) }));
  updateControls();
}

function cancelReply() {
  const reply = state.reply;
  if (!reply || reply.cancelRequested) return;
  reply.cancelRequested = true;
  if (state.connected) state.socket.send(JSON.stringify({ type: "cancel", id: reply.id }));
  updateControls();
}

function onChunk(reply, data) {
  const now = performance.now();
  for (const choice of data.choices ?? []) {
    const thought = choice.delta?.reasoning ?? choice.delta?.reasoning_content;
    if (thought) {
      reply.msg.reasoning = (reply.msg.reasoning ?? "") + thought;
      reply.chunks += 1;
      reply.first ??= now;
      reply.last = now;
    }
    const text = choice.delta?.content;
    if (text) {
      reply.msg.content += text;
      reply.chunks += 1;
      reply.first ??= now;
      reply.last = now;
    }
    if (choice.finish_reason) reply.finish = choice.finish_reason;
  }
  if (data.usage) reply.usage = data.usage;
  if (!reply.renderQueued) { // one render per frame, however many chunks arrived
    reply.renderQueued = true;
    requestAnimationFrame(() => {
      reply.renderQueued = false;
      if (state.reply === reply) updateMessage(reply.msg);
    });
  }
}

function finishReply(reply, finish, error = null) {
  if (state.reply !== reply) return;
  state.reply = null;
  const tokens = reply.usage?.completion_tokens ?? reply.chunks;
  const seconds = (reply.last - reply.first) / 1000;
  reply.msg.stats = {
    ttft: reply.first === null ? null : (reply.first - reply.start) / 1000,
    tps: tokens > 1 && seconds > 0 ? (tokens - 1) / seconds : null, // decode rate after the first
    tokens,
    finish,
  };
  reply.msg.error = error;
  reply.chat.updated = Date.now();
  saveChats();
  updateMessage(reply.msg);
  updateControls();
}

function onFrame(frame) {
  const reply = state.reply && frame.id === state.reply.id ? state.reply : null;
  if (frame.type === "auth" && frame.ok) {
    onConnected();
  } else if (frame.type === "chunk" && reply) {
    onChunk(reply, frame.data);
  } else if (frame.type === "done" && reply) {
    finishReply(reply, frame.cancelled ? "cancelled" : reply.finish);
  } else if (frame.type === "error") {
    const error = frame.error ?? {};
    if (error.code === "invalid_api_key") {
      keyRefused();
    } else if (reply) {
      // A cancel that crossed the reply's end is answered "no running request": the
      // "done" frame follows, so this is no error of the reply's.
      if (reply.cancelRequested && error.param === "id") return;
      finishReply(reply, "error", error.message ?? "the server sent an error");
    } else if (frame.id == null) {
      notice(`Server error: ${error.message}`);
    }
  }
}

// ---- The connection ------------------------------------------------------------------

function setStatus(kind, text) {
  ui.status.dataset.state = kind;
  ui.status.textContent = text;
}

const apiKey = () => sessionStorage.getItem(API_KEY_KEY);

// GET v1/models, first without the key: a 401 means this server needs one.
async function fetchModels() {
  let res = await fetch("v1/models", { cache: "no-store" });
  state.needsKey = res.status === 401;
  if (state.needsKey && apiKey()) {
    res = await fetch("v1/models", { cache: "no-store",
                                     headers: { Authorization: `Bearer ${apiKey()}` } });
  }
  return res;
}

async function connect() {
  clearTimeout(state.retryTimer);
  if (state.attempt) setStatus("reconnecting", "Reconnecting\u2026");
  else setStatus("connecting", "Connecting\u2026");
  let res;
  try {
    res = await fetchModels();
  } catch {
    return retry();
  }
  if (res.status === 401) return askForKey(apiKey() ? "That key was refused; try again." : null);
  if (res.status === 503) {
    setStatus("loading", "Model loading\u2026");
    state.retryTimer = setTimeout(connect, 1000);
    return;
  }
  if (!res.ok) return retry();
  showModels((await res.json()).data);
  const url = new URL("v1/ws", location.href);
  url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  const ws = new WebSocket(url);
  state.socket = ws;
  ws.onopen = () => {
    if (state.needsKey) ws.send(JSON.stringify({ type: "auth", api_key: apiKey() }));
    else onConnected();
  };
  ws.onmessage = (event) => {
    let frame;
    try {
      frame = JSON.parse(event.data);
    } catch {
      return;
    }
    onFrame(frame);
  };
  ws.onclose = () => {
    if (state.socket !== ws) return; // closed on purpose
    state.socket = null;
    onDisconnected();
  };
}

// The models the server lists: a choice among them where it has LoRA adapters besides the
// model (the last chosen kept, while the server still lists it).
function showModels(models) {
  state.models = models;
  ui.modelChoice.hidden = models.length < 2;
  ui.modelSelect.replaceChildren(...models.map((m) => {
    const option = document.createElement("option");
    option.value = m.id;
    option.textContent = m.parent ? `${m.id} (adapter of ${m.parent})` : m.id;
    return option;
  }));
  const chosen = models.find((m) => m.id === state.settings.model) || models[0];
  ui.modelSelect.value = chosen.id;
  showModel(chosen);
}

function chooseModel() {
  const model = state.models.find((m) => m.id === ui.modelSelect.value);
  if (!model) return;
  state.settings.model = model === state.models[0] ? "" : model.id;
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(state.settings));
  showModel(model);
  if (!currentChat()) renderChat();
}

function showModel(model) {
  const first = !state.model;
  state.model = model;
  ui.modelName.textContent = model.id;
  ui.settingsModel.textContent = model.id;
  ui.maxModelLen.textContent = String(model.max_model_len);
  if (first && !currentChat()) renderChat();
}

function onConnected() {
  state.connected = true;
  state.attempt = 0;
  setStatus("connected", "Connected");
  updateControls();
}

function onDisconnected() {
  state.connected = false;
  if (state.reply) finishReply(state.reply, "disconnected", "The connection dropped; the reply stopped here.");
  updateControls();
  retry();
}

// Back off 0.5 s, 1 s, 2 s, ... up to 15 s between tries, saying so in the status line.
function retry() {
  const delay = Math.min(500 * 2 ** state.attempt, MAX_BACKOFF_MS);
  state.attempt += 1;
  setStatus("reconnecting",
            `Disconnected: reconnecting in ${Math.round(delay / 100) / 10} s (try ${state.attempt})`);
  state.retryTimer = setTimeout(connect, delay);
}

function askForKey(message) {
  setStatus("auth", "API key needed");
  ui.keyMessage.textContent = message ?? "This server needs an API key.";
  ui.keyMessage.classList.toggle("wrong", Boolean(message));
  sessionStorage.removeItem(API_KEY_KEY);
  ui.keyInput.value = "";
  if (!ui.keyDialog.open) ui.keyDialog.showModal();
  ui.keyInput.focus();
}

function keyRefused() {
  const ws = state.socket;
  state.socket = null;
  state.connected = false;
  ws?.close();
  updateControls();
  askForKey("That key was refused; try again.");
}

// ---- Wiring --------------------------------------------------------------------------

function autosize() {
  ui.input.style.height = "auto";
  ui.input.style.height = `${ui.input.scrollHeight + 2}px`;
}

ui.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
ui.input.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
ui.input.addEventListener("input", autosize);
ui.stop.addEventListener("click", cancelReply);
ui.modelSelect.addEventListener("change", chooseModel);
ui.newChat.addEventListener("click", () => {
  state.currentId = null;
  saveChats();
  renderSidebar();
  renderChat();
  showSidebar(false);
  ui.input.focus();
});
ui.toggleSidebar.addEventListener("click", () => showSidebar(!ui.app.classList.contains("sidebar-open")));
ui.backdrop.addEventListener("click", () => showSidebar(false));
ui.toggleSettings.addEventListener("click", () => {
  ui.settings.hidden = !ui.settings.hidden;
  ui.toggleSettings.setAttribute("aria-expanded", String(!ui.settings.hidden));
});
ui.keyForm.addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(API_KEY_KEY, ui.keyInput.value);
  ui.keyDialog.close();
  connect();
});
ui.keyDialog.addEventListener("cancel", (event) => event.preventDefault()); // Esc: stay
window.addEventListener("storage", (event) => { // another tab changed the conversations
  if (event.key !== CHATS_KEY) return;
  // Take the other tab's list, but a reply streaming here keeps this tab's copy of its chat
  // (newer than any the other tab saved), so that neither tab's next save loses the other's.
  const mine = state.reply?.chat;
  const stored = loadJSON(CHATS_KEY, []);
  state.chats = mine ? [...stored.filter((c) => c.id !== mine.id), mine] : stored;
  renderSidebar();
  if (!mine || mine.id !== state.currentId) renderChat();
});

loadSettings();
renderSidebar();
renderChat();
connect();
