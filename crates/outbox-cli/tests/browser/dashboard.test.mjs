// The admin dashboard end to end in Debian's Chromium (headless), driven by playwright-core:
// a SQLite outbox with dispatched, dead and pending rows made by the `outbox` binary;
// `outbox serve` with an operator token; the overview, dead letters filtered and opened, a
// replay with a reason (dry-run count first) delivered by a relay, a topic pause that a
// relay honours, the audit; labels and the contrast of the status colours checked in the
// page; the header's verdict badge on every page, "sign out" only with a token;
// screenshots and the overview's page weight saved as artifacts.
//
// Run: `npm ci && node --test` in this directory, with the binary built
// (`cargo build -p outbox-cli`; OUTBOX_BIN names it, else target/debug/outbox).

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawn, spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import net from "node:net";
import { fileURLToPath } from "node:url";
import { chromium } from "playwright-core";

const here = path.dirname(fileURLToPath(import.meta.url));
const repo = path.resolve(here, "../../../..");
const targetDir = process.env.CARGO_TARGET_DIR || path.join(repo, "target");
const BIN = process.env.OUTBOX_BIN || path.join(targetDir, "debug", "outbox");
const ARTIFACTS = process.env.DASHBOARD_ARTIFACTS || path.join(targetDir, "dashboard-artifacts");
const CHROMIUM = process.env.CHROMIUM || "/usr/bin/chromium";
const TOKEN = "e2e-operator-token-0123456789";

const dir = fs.mkdtempSync(path.join(os.tmpdir(), "outbox-dash-"));
const db = `sqlite://${path.join(dir, "e2e.db")}`;
const outFile = path.join(dir, "delivered.jsonl");
let server, browser, page, port, weight = null;

// Runs the binary; it must exit with `code` (0; `relay --drain` exits 4 when it
// quarantined messages).
function outbox(args, env = {}, code = 0) {
  const r = spawnSync(BIN, ["--database-url", db, ...args], {
    encoding: "utf8",
    timeout: 60_000,
    env: { ...process.env, OUTBOX_LOG: "warn", OUTBOX_DATABASE_URL: "", ...env },
  });
  assert.equal(r.status, code, `outbox ${args.join(" ")} failed: ${r.stderr}`);
  return r.stdout;
}
const enqueue = (topic, payload, key) =>
  JSON.parse(outbox(["enqueue", "--topic", topic, "--payload", payload, ...(key ? ["--key", key] : [])]));
const routes = (...r) => r.flatMap((x) => ["--route", x]);
const delivered = () =>
  fs.existsSync(outFile) ? fs.readFileSync(outFile, "utf8").trim().split("\n").filter(Boolean).map((l) => JSON.parse(l)) : [];

function freePort() {
  return new Promise((resolve) => {
    const s = net.createServer().listen(0, "127.0.0.1", () => {
      const p = s.address().port;
      s.close(() => resolve(p));
    });
  });
}

async function waitHealthy(url) {
  for (let i = 0; i < 100; i++) {
    try {
      if ((await fetch(url)).ok) return;
    } catch {}
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error("the admin server did not start");
}

const shot = (name) => page.screenshot({ path: path.join(ARTIFACTS, name), fullPage: true });

before(async () => {
  assert.ok(fs.existsSync(BIN), `build the binary first: ${BIN} is missing`);
  assert.ok(fs.existsSync(CHROMIUM), `install Debian's chromium: ${CHROMIUM} is missing`);
  fs.mkdirSync(ARTIFACTS, { recursive: true });
  outbox(["migrate"]);
  // Dispatched: four pings through a file route; dead: orders and billing have no route.
  for (let i = 0; i < 4; i++) enqueue("ok.ping.v1", `{"ping":${i}}`);
  for (let i = 0; i < 3; i++) enqueue("orders.placed.v1", `{"order":${i},"total":"19.90"}`, `cust-${i}`);
  for (let i = 0; i < 2; i++) enqueue("billing.invoice.v1", `{"invoice":${i}}`);
  outbox(["relay", "--drain", ...routes(`ok.>=file:${outFile}`)], {}, 4);
  assert.equal(delivered().length, 4);
  // Pending: two more pings, no relay running.
  enqueue("ok.ping.v1", `{"ping":"late-1"}`);
  enqueue("ok.ping.v1", `{"ping":"late-2"}`);
  port = await freePort();
  server = spawn(BIN, ["--database-url", db, "serve", "--listen", `127.0.0.1:${port}`], {
    env: { ...process.env, OUTBOX_ADMIN_TOKEN: TOKEN, OUTBOX_LOG: "warn" },
    stdio: ["ignore", "ignore", "inherit"],
  });
  await waitHealthy(`http://127.0.0.1:${port}/healthz`);
  browser = await chromium.launch({
    executablePath: CHROMIUM,
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync"],
  });
  page = await browser.newPage({ viewport: { width: 1280, height: 900 } });
});

after(async () => {
  await browser?.close();
  server?.kill();
  fs.rmSync(dir, { recursive: true, force: true });
});

test("sign in and read the overview", async () => {
  // Bytes on the wire for the overview: the page, /api/me and /api/overview.
  const cdp = await page.context().newCDPSession(page);
  await cdp.send("Network.enable");
  await cdp.send("Network.setCacheDisabled", { cacheDisabled: true });
  const sizes = new Map();
  cdp.on("Network.responseReceived", (e) => sizes.set(e.requestId, { url: e.response.url, bytes: 0 }));
  cdp.on("Network.loadingFinished", (e) => { if (sizes.has(e.requestId)) sizes.get(e.requestId).bytes = e.encodedDataLength; });

  await page.goto(`http://127.0.0.1:${port}/`);
  const token = page.getByLabel("Admin token");
  await token.waitFor();
  await token.fill(TOKEN);
  await page.getByRole("button", { name: "Sign in" }).click();
  await page.locator("#c-pending .value").waitFor();
  await page.waitForFunction(() => document.querySelector("#c-dead .value")?.textContent === "5");
  const card = async (id) => (await page.locator(`#c-${id} .value`).textContent()).trim();
  assert.equal(await card("pending"), "2");
  assert.equal(await card("dispatched"), "4");
  assert.equal(await card("dead"), "5");
  assert.equal(await page.locator("#verdict-state").textContent(), "DEAD");
  assert.match(await page.locator("#verdict-text").textContent(), /5 dead letters/);
  assert.match(await page.locator("#chart-total").textContent(), /4 dispatched, 5 died/);
  assert.ok(await page.locator("#chart svg rect").count() >= 1, "the chart has bars");
  assert.match(await page.locator("#dead-topics").textContent(), /orders\.placed\.v1\s*3/);
  await page.waitForTimeout(300);
  const loaded = [...sizes.values()].filter((s) => s.url.startsWith(`http://127.0.0.1:${port}/`));
  weight = loaded.reduce((a, s) => a + s.bytes, 0);
  fs.writeFileSync(path.join(ARTIFACTS, "page-weight.txt"),
    loaded.map((s) => `${s.bytes}\t${s.url}`).join("\n") + `\n${weight}\ttotal (bytes transferred for the overview)\n`);
  console.log(`page weight of the overview: ${weight} bytes (${loaded.length} requests)`);
  assert.ok(weight > 0 && weight < 100_000, `the overview is small: ${weight} bytes`);
  await cdp.detach();
  await shot("overview.png");
});

test("labels, keyboard tabs and the contrast of status colours", async () => {
  const problems = await page.evaluate(() => {
    const bad = [];
    for (const el of document.querySelectorAll("input, select, textarea")) {
      if (!(el.labels && el.labels.length) && !el.getAttribute("aria-label")) bad.push(`input #${el.id} has no label`);
    }
    for (const b of document.querySelectorAll("button")) {
      if (!(b.textContent.trim() || b.getAttribute("aria-label"))) bad.push(`button without a name: ${b.outerHTML}`);
    }
    return bad;
  });
  assert.deepEqual(problems, []);
  // The tabs follow the keyboard (arrow keys), as the WAI-ARIA tabs pattern has it.
  await page.getByRole("tab", { name: "Overview" }).focus();
  await page.keyboard.press("ArrowRight");
  assert.equal(await page.getByRole("tab", { name: "Dead letters" }).getAttribute("aria-selected"), "true");
  assert.equal(await page.locator("#dead").isVisible(), true);
  await page.keyboard.press("ArrowLeft");
  assert.equal(await page.getByRole("tab", { name: "Overview" }).getAttribute("aria-selected"), "true");
  // WCAG 2 contrast of every status colour, computed from the page's own styles.
  const ratios = await page.evaluate(() => {
    const lum = (rgb) => {
      const [r, g, b] = rgb.match(/\d+(\.\d+)?/g).slice(0, 3).map(Number).map((v) => {
        v /= 255;
        return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4;
      });
      return 0.2126 * r + 0.7152 * g + 0.0722 * b;
    };
    const out = {};
    for (const s of ["ok", "pending", "parked", "claimed", "dispatched", "dead", "stuck", "behind", "blocked", "paused", "up", "down", "open", "none"]) {
      const b = document.createElement("span");
      b.className = "badge s-" + s;
      b.textContent = s;
      document.body.append(b);
      const cs = getComputedStyle(b);
      const [l1, l2] = [lum(cs.color), lum(cs.backgroundColor)].sort((a, b) => b - a);
      out[s] = (l1 + 0.05) / (l2 + 0.05);
      b.remove();
    }
    return out;
  });
  for (const [s, r] of Object.entries(ratios)) assert.ok(r >= 4.5, `status ${s}: contrast ${r.toFixed(2)} is below 4.5:1`);
  fs.writeFileSync(path.join(ARTIFACTS, "contrast.json"), JSON.stringify(ratios, null, 2));
});

test("filter dead letters, open one, replay it with a reason, see it delivered", async () => {
  await page.getByRole("tab", { name: "Dead letters" }).click();
  await page.waitForFunction(() => /5 dead letters match/.test(document.querySelector("#dead-count").textContent));
  await page.getByLabel("Topic pattern", { exact: true }).fill("orders.>");
  await page.getByRole("button", { name: "Filter" }).click();
  await page.waitForFunction(() => /^3 dead letters match/.test(document.querySelector("#dead-count").textContent));
  assert.equal(await page.locator("#dead-table tbody tr").count(), 3);
  await page.getByLabel("Error contains").fill("NO ROUTE");
  await page.getByRole("button", { name: "Filter" }).click();
  await page.waitForFunction(() => /^3 dead letters match/.test(document.querySelector("#dead-count").textContent));

  const first = page.locator("#dead-table tbody tr").first().getByRole("button");
  const id = (await first.textContent()).trim();
  await first.click();
  const detail = page.locator("#dead-letter");
  await detail.waitFor();
  assert.match(await detail.textContent(), /orders\.placed\.v1/);
  assert.match(await page.locator("#last-error").textContent(), /no route for topic/);
  assert.equal(await page.locator("#payload").count(), 0, "the payload is hidden by default");
  await page.getByRole("button", { name: /Show payload/ }).click();
  await page.locator("#payload").waitFor();
  assert.equal(await page.locator("#payload").textContent(), '{"order":0,"total":"19.90"}');
  const [download] = await Promise.all([
    page.waitForEvent("download"),
    page.getByRole("button", { name: /Download payload/ }).click(),
  ]);
  assert.equal(fs.readFileSync(await download.path(), "utf8"), '{"order":0,"total":"19.90"}', "the download is the whole payload");
  const messageId = (await detail.locator("dd .mono").first().textContent()).trim();
  await shot("dead-letter.png");

  // Select it; a reason; the dry run's count first; then the replay.
  await page.getByLabel(`Select dead letter ${id}`).check();
  await page.getByLabel("Reason (kept in the audit)").fill("route for orders added");
  await page.getByRole("button", { name: "Replay…" }).click();
  await page.locator("#dry-run").waitFor();
  assert.match(await page.locator("#dry-run").textContent(), /Dry run: 1 dead letter would be replayed \(ids \d+\)/);
  await page.getByRole("button", { name: "Confirm: replay 1" }).click();
  await page.locator("#change-done").waitFor();
  assert.match(await page.locator("#change-done").textContent(), /Replayed 1 dead letter \(audit id \d+\)/);
  await page.waitForFunction(() => /^2 dead letters match/.test(document.querySelector("#dead-count").textContent));

  // A relay with a route for orders delivers it (and the pending pings).
  outbox(["relay", "--drain", ...routes(`ok.>=file:${outFile}`, `orders.>=file:${outFile}`)]);
  const got = delivered().filter((m) => m.message_id === messageId);
  assert.equal(got.length, 1, "the replayed message was delivered once, same message id");
  assert.equal(got[0].topic, "orders.placed.v1");

  await page.getByRole("tab", { name: "Messages" }).click();
  await page.getByLabel("Message id or key").fill(messageId);
  await page.getByRole("button", { name: "Find" }).click();
  await page.locator("#msg-result tbody tr").waitFor();
  assert.equal((await page.locator("#msg-result tbody tr .badge").textContent()).trim(), "dispatched");
  assert.match(await page.locator("#msg-result").textContent(), /dispatched .* ago/);
  await shot("messages.png");

  await page.getByRole("tab", { name: "Replays" }).click();
  await page.locator("#replays-table tbody tr").first().waitFor();
  const audit = await page.locator("#replays-table tbody tr").first().textContent();
  assert.match(audit, /replay/);
  assert.match(audit, /admin/);
  assert.match(audit, /route for orders added/);
  await shot("replays.png");
});

test("pause a topic: a relay does not publish it until resumed", async () => {
  await page.getByRole("tab", { name: "Overview" }).click();
  await page.getByLabel("Topic pattern (empty: every topic)").fill("ok.>");
  await page.getByLabel("Reason", { exact: true }).fill("consumer deploy");
  await page.getByRole("button", { name: "Pause", exact: true }).click();
  await page.getByRole("button", { name: "Resume ok.>" }).waitFor();
  assert.match(await page.locator("#pauses").textContent(), /ok\.>\s*consumer deploy\s*admin/);

  const before = delivered().length;
  const paused = enqueue("ok.ping.v1", `{"ping":"while-paused"}`);
  const other = enqueue("orders.placed.v1", `{"order":"during-pause"}`, "cust-9");
  outbox(["relay", "--drain", ...routes(`ok.>=file:${outFile}`, `orders.>=file:${outFile}`)]);
  const now = delivered();
  assert.equal(now.length, before + 1, "only the unpaused topic was published");
  assert.ok(now.some((m) => m.message_id === other.message_id));
  assert.ok(!now.some((m) => m.message_id === paused.message_id), "the paused topic was not published");
  await page.waitForFunction(() => document.querySelector("#c-pending .value")?.textContent === "1", null, { timeout: 10_000 });
  await shot("paused.png");

  await page.getByRole("button", { name: "Resume ok.>" }).click();
  await page.waitForFunction(() => /nothing is paused/.test(document.querySelector("#pauses").textContent));
  outbox(["relay", "--drain", ...routes(`ok.>=file:${outFile}`, `orders.>=file:${outFile}`)]);
  assert.ok(delivered().some((m) => m.message_id === paused.message_id), "delivered once resumed");
});

test("a wrong token is refused and asked again", async () => {
  const ctx = await browser.newContext();
  const p = await ctx.newPage();
  await p.goto(`http://127.0.0.1:${port}/`);
  await p.getByLabel("Admin token").fill("wrong-token-0123456789abc");
  await p.getByRole("button", { name: "Sign in" }).click();
  await p.getByText("the token is not valid").waitFor();
  assert.equal(await p.locator("#app").isHidden(), true);
  await ctx.close();
});

test("the verdict badge is filled on every page, and sign out is offered with a token", async () => {
  const ctx = await browser.newContext();
  const p = await ctx.newPage();
  // Opened on the dead letters: the header's badge is the overview's verdict all the same.
  await p.goto(`http://127.0.0.1:${port}/#dead`);
  await p.getByLabel("Admin token").fill(TOKEN);
  await p.getByRole("button", { name: "Sign in" }).click();
  await p.getByRole("tab", { name: /Replays/ }).click();
  await p.waitForFunction(() => document.querySelector("#verdict-badge").textContent !== "…");
  assert.match(await p.locator("#verdict-badge").textContent(), /^(DEAD|OK|BEHIND|STUCK|PAUSED|BLOCKED)$/);
  assert.equal(await p.locator("#signout").isVisible(), true);
  await p.locator("#signout").click();
  await p.getByLabel("Admin token").waitFor();
  assert.equal(await p.locator("#app").isHidden(), true);
  await ctx.close();
});

test("a server without a token offers no sign out", async () => {
  const openPort = await freePort();
  const env = { ...process.env, OUTBOX_LOG: "error" };
  for (const v of ["OUTBOX_ADMIN_TOKEN", "OUTBOX_ADMIN_READ_TOKEN", "OUTBOX_ADMIN_TOKENS_FILE"]) delete env[v];
  const open = spawn(BIN, ["--database-url", db, "serve", "--listen", `127.0.0.1:${openPort}`], {
    env,
    stdio: ["ignore", "ignore", "inherit"],
  });
  try {
    await waitHealthy(`http://127.0.0.1:${openPort}/healthz`);
    const ctx = await browser.newContext();
    const p = await ctx.newPage();
    await p.goto(`http://127.0.0.1:${openPort}/#replays`);
    await p.waitForFunction(() => document.querySelector("#who").textContent.startsWith("local"));
    await p.waitForFunction(() => document.querySelector("#verdict-badge").textContent !== "…");
    assert.equal(await p.locator("#signout").isHidden(), true);
    assert.equal(await p.locator("#login").isHidden(), true);
    await ctx.close();
  } finally {
    open.kill();
  }
});
