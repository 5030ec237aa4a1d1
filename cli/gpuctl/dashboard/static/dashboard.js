// gpuctl dashboard: refresh a page's live part, follow a log, ask before an action. Text from
// the nodes is only ever set as text (textContent, text nodes), never parsed as HTML.
"use strict";

function problem(text) {
  const box = document.getElementById("problem");
  if (!box) return;
  box.hidden = !text;
  box.textContent = text || "";
}

async function refresh(section) {
  try {
    const answer = await fetch(location.href, {credentials: "same-origin", headers: {"Accept": "text/html"}});
    if (!answer.ok) throw new Error(`the dashboard answered ${answer.status}`);
    const doc = new DOMParser().parseFromString(await answer.text(), "text/html");
    const fresh = doc.getElementById("live");
    if (fresh) section.replaceChildren(...fresh.childNodes);
    const stamp = doc.getElementById("updated");
    if (stamp) document.getElementById("updated").textContent = stamp.textContent;
    problem("");
  } catch (err) {
    problem(`Could not refresh this page: ${err.message}. Is \`gpuctl dashboard\` still running?`);
  }
}

function refreshLive(section) {
  const every = parseFloat(section.dataset.refresh || "0");
  if (!(every > 0)) return;
  setInterval(() => { if (!document.hidden) refresh(section); }, every * 1000);
}

function followLog(pre) {
  const state = document.getElementById("log-state");
  const say = (text) => { if (state) state.textContent = text; };
  const source = new EventSource(pre.dataset.src);
  let lines = 0;
  source.onopen = () => say("live");
  source.onmessage = (event) => {
    const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 8;
    pre.appendChild(document.createTextNode(event.data + "\n"));
    lines += 1;
    if (atBottom) pre.scrollTop = pre.scrollHeight;
  };
  source.addEventListener("failure", (event) => problem(event.data));
  source.addEventListener("end", (event) => {
    source.close();
    const live = document.getElementById("live");
    if (live) refresh(live);  // the job's (or action's) end, in the page's facts at once
    let how = {};
    try { how = JSON.parse(event.data); } catch (err) { how = {}; }
    if (how.returncode !== undefined && how.returncode !== null) {
      say(how.returncode === 0 ? "done" : `failed (exit code ${how.returncode})`);
    } else {
      say(`${lines} line(s)` + (how.status ? `; the job is ${how.status}` : ""));
    }
  });
  source.onerror = () => { if (source.readyState !== EventSource.CLOSED) say("reconnecting…"); };
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("[data-refresh]").forEach(refreshLive);
  document.querySelectorAll("pre.log[data-src]").forEach(followLog);
});

// on the document: a form that a refresh put in the page asks too
document.addEventListener("submit", (event) => {
  const form = event.target.closest("form[data-confirm]");
  if (form && !window.confirm(form.dataset.confirm)) event.preventDefault();
});
