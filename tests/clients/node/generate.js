// Streams one Generate call from a cleave gateway using only protos/ and the npm packages.
// Usage: node generate.js PROTO_ROOT GATEWAY_ADDRESS PROMPT [CA_FILE]
// With CA_FILE the call goes over TLS, the gateway checked against that CA.
// Prints one JSON line: {"text", "reasoning", "finish_reason", "completion_tokens", "messages"}.
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const fs = require("fs");
const path = require("path");

const [protoRoot, address, prompt, caFile] = process.argv.slice(2);
const definition = protoLoader.loadSync(path.join(protoRoot, "cleave/v1/gateway.proto"), {
  includeDirs: [protoRoot],
  keepCase: true,
  longs: Number,
  enums: String,
  defaults: true,
  oneofs: true,
});
const cleave = grpc.loadPackageDefinition(definition).cleave.v1;
const credentials = caFile ? grpc.credentials.createSsl(fs.readFileSync(caFile)) : grpc.credentials.createInsecure();
const client = new cleave.Gateway(address, credentials);

let text = "";
let reasoning = "";
let finishReason = "";
let completionTokens = 0;
let messages = 0;
const call = client.Generate({ text: prompt, sampling: { max_tokens: 12, temperature: 0 } });
call.on("data", (response) => {
  messages += 1;
  for (const sample of response.samples) {
    text += sample.text;
    reasoning += sample.reasoning_text;
    if (sample.finish_reason !== "FINISH_REASON_UNSPECIFIED") finishReason = sample.finish_reason;
  }
  if (response.usage) completionTokens = response.usage.completion_tokens;
});
call.on("error", (error) => {
  console.error(`Generate failed: ${error.code} ${error.details}`);
  process.exit(1);
});
call.on("end", () => {
  console.log(JSON.stringify({ text, reasoning, finish_reason: finishReason, completion_tokens: completionTokens, messages }));
  client.close();
});
