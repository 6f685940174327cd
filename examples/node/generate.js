#!/usr/bin/env node
// Stream a generation from a pagedserve gateway (pagedserve.v1.Generation/Generate).
//
//   node generate.js [--address HOST:PORT] [--max-tokens N] [--temperature T] PROMPT
//
// The text goes to stdout as it arrives; the finish reason and token usage go to stderr at
// the end. Exit status: 0 when every sample finished, 1 on a gRPC error, 2 on bad usage.
// The proto is loaded at run time from the repository's protos/ (no generated code).
'use strict';

const path = require('node:path');
const { parseArgs } = require('node:util');
const fs = require('node:fs');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = path.resolve(__dirname, '../../protos');
const PROTO_FILE = path.join(PROTO_ROOT, 'pagedserve/v1/generation.proto');

const USAGE = `usage: node generate.js [options] PROMPT

options:
  --address HOST:PORT   gateway address (default $PAGEDSERVE_ADDRESS or localhost:50051)
  --max-tokens N        tokens to generate (default 64)
  --temperature T       0 = greedy (default: the server's, 1.0)
  --top-p P, --top-k K, --seed S
  --stop STRING         stop string (repeatable)
  --tls-ca FILE         connect with TLS, trusting this PEM CA certificate
  --timeout SECONDS     deadline of the whole call
  -h, --help

environment:
  PAGEDSERVE_API_KEY    sent as \`authorization: Bearer <key>\` when set
  PAGEDSERVE_ADDRESS    default gateway address`;

function parseCommandLine(argv) {
  const { values, positionals } = parseArgs({
    args: argv,
    allowPositionals: true,
    options: {
      address: { type: 'string' },
      'max-tokens': { type: 'string', default: '64' },
      temperature: { type: 'string' },
      'top-p': { type: 'string' },
      'top-k': { type: 'string' },
      seed: { type: 'string' },
      stop: { type: 'string', multiple: true, default: [] },
      'tls-ca': { type: 'string' },
      timeout: { type: 'string' },
      help: { type: 'boolean', short: 'h', default: false },
    },
  });
  if (values.help) {
    return { help: true };
  }
  if (positionals.length !== 1) {
    throw new Error('exactly one PROMPT is needed');
  }
  const number = (name, parse) => {
    if (values[name] === undefined) return undefined;
    const n = parse(values[name]);
    if (!Number.isFinite(n)) throw new Error(`--${name} must be a number, got ${values[name]}`);
    return n;
  };
  const params = {
    max_tokens: number('max-tokens', (s) => Number.parseInt(s, 10)),
    temperature: number('temperature', Number.parseFloat),
    top_p: number('top-p', Number.parseFloat),
    top_k: number('top-k', (s) => Number.parseInt(s, 10)),
    seed: values.seed, // uint64: passed as a string, exactly
    stop: values.stop,
  };
  // Only the fields that were given: unset optional fields take the server's defaults.
  const samplingParams = Object.fromEntries(
    Object.entries(params).filter(([, v]) => v !== undefined),
  );
  return {
    prompt: positionals[0],
    address: values.address || process.env.PAGEDSERVE_ADDRESS || 'localhost:50051',
    tlsCa: values['tls-ca'],
    timeoutS: number('timeout', Number.parseFloat),
    samplingParams,
  };
}

function loadGenerationService() {
  const definition = protoLoader.loadSync(PROTO_FILE, {
    includeDirs: [PROTO_ROOT],
    keepCase: true,
    longs: String,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).pagedserve.v1.Generation;
}

function main(argv) {
  let options;
  try {
    options = parseCommandLine(argv);
  } catch (err) {
    process.stderr.write(`error: ${err.message}\n\n${USAGE}\n`);
    return Promise.resolve(2);
  }
  if (options.help) {
    process.stdout.write(`${USAGE}\n`);
    return Promise.resolve(0);
  }

  const Generation = loadGenerationService();
  const credentials = options.tlsCa
    ? grpc.credentials.createSsl(fs.readFileSync(options.tlsCa))
    : grpc.credentials.createInsecure();
  const client = new Generation(options.address, credentials);

  const metadata = new grpc.Metadata();
  if (process.env.PAGEDSERVE_API_KEY) {
    metadata.set('authorization', `Bearer ${process.env.PAGEDSERVE_API_KEY}`);
  }
  const callOptions = {};
  if (options.timeoutS !== undefined) {
    callOptions.deadline = new Date(Date.now() + options.timeoutS * 1000);
  }
  const request = { prompt: options.prompt, sampling_params: options.samplingParams };

  return new Promise((resolve) => {
    const call = client.Generate(request, metadata, callOptions);
    const finals = [];
    let done = false;
    const finish = (code) => {
      if (done) return;
      done = true;
      client.close();
      resolve(code);
    };
    process.once('SIGINT', () => call.cancel()); // the gateway aborts the request

    call.on('data', (response) => {
      if (response.text) process.stdout.write(response.text);
      if (response.finish_reason !== 'FINISH_REASON_UNSPECIFIED') finals.push(response);
    });
    // A failed call emits 'error' (then possibly 'end'); a successful one 'end' after the
    // last 'data'.
    call.on('error', (err) => {
      const name = Object.keys(grpc.status).find((k) => grpc.status[k] === err.code);
      process.stderr.write(`\nerror: ${name || err.code}: ${err.details || err.message}\n`);
      finish(1);
    });
    call.on('end', () => {
      if (done) return;
      process.stdout.write('\n');
      for (const f of finals) {
        const u = f.usage || {};
        process.stderr.write(
          `[${f.index}] finish_reason=${f.finish_reason} prompt_tokens=${u.prompt_tokens} ` +
            `completion_tokens=${u.completion_tokens} ` +
            `cached_prompt_tokens=${u.cached_prompt_tokens}\n`,
        );
      }
      if (finals.length === 0) {
        process.stderr.write('error: the stream ended without a final message\n');
      }
      finish(finals.length > 0 ? 0 : 1);
    });
  });
}

main(process.argv.slice(2)).then((code) => {
  process.exitCode = code;
});
