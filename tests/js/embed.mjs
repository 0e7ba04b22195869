// The Node `openai` SDK as an application calls it, against the gateway at `baseURL`.
// stdin: {"baseURL": "http://127.0.0.1:PORT/v1", "calls": [{"model": ..., "input": ..., ...}, ...]}, each call's
// fields passed to `client.embeddings.create` unchanged.
// stdout: {"results": [...]}, one per call: {"embeddings": [[...]], "index": [...], "model", "usage",
// "sent": the JSON body that went on the wire, "wire": "string" or "array", what data[0].embedding was in the
// gateway's answer before the SDK decoded it}, or {"error": {"status", "message"}, "sent"} for a call that failed.
import OpenAI from 'openai';

const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const { baseURL, calls } = JSON.parse(Buffer.concat(chunks).toString('utf8'));

let sent = null;
let wire = null;
// The SDK's own fetch, watched: what the SDK sent, and what the gateway's answer held before the SDK decoded it.
const watching = async (url, init) => {
  sent = JSON.parse(init.body);
  const response = await fetch(url, init);
  const body = await response.clone().json().catch(() => null);
  const first = body && Array.isArray(body.data) && body.data.length ? body.data[0].embedding : undefined;
  wire = Array.isArray(first) ? 'array' : first === undefined ? null : typeof first;
  return response;
};
const client = new OpenAI({ baseURL, apiKey: 'unused', maxRetries: 0, timeout: 60_000, fetch: watching });

const results = [];
for (const call of calls) {
  try {
    const answer = await client.embeddings.create(call);
    results.push({
      embeddings: answer.data.map((d) => Array.from(d.embedding)),
      index: answer.data.map((d) => d.index),
      model: answer.model,
      usage: answer.usage,
      sent,
      wire,
    });
  } catch (error) {
    results.push({ error: { status: error.status ?? null, message: String(error.message) }, sent });
  }
}
process.stdout.write(JSON.stringify({ results }));
