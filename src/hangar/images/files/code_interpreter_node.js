// The code interpreter's JavaScript and TypeScript kernel, run inside a code-interpreter
// guest by its server (code_interpreter.py, NodeKernel): `node code_interpreter_node.js FD
// LANGUAGE`. It reads one JSON request a line on stdin and writes JSON lines on the
// descriptor FD, the server's protocol lines plus its own:
//   {"op": "run", "code", "env", "typescript"?}   runs a cell (TypeScript: transpiled): "stdout"/"stderr" lines (console and the
//                                  process's streams), a "result" (the value of the last
//                                  expression: a string as it is, anything else as
//                                  util.inspect shows it), an "error", then "done";
//   {"op": "become", "uid", "gid", "groups", "env", "cwd"}   the user (from root, once),
//                                  the variables and the folder, then "done";
//   {"op": "chdir", "cwd"}         then "done".
// Written first: {"type": "ready"}. Cells run in this process's global scope, so
// declarations stay between cells. `import ... from 'm'` lines become require() calls
// (Node's built-in and installed CommonJS modules), a cell that uses `await` runs in an
// async function whose top-level `const`/`let`/`var` of plain names go to the global scope,
// and a TypeScript cell is transpiled first by Debian's TypeScript (loaded on first use; the
// default JavaScript context also runs the cells of language `ts` given no context).
'use strict';

const fs = require('fs');
const path = require('path');
const util = require('util');
const vm = require('vm');
const readline = require('readline');
const Module = require('module');
const { Console } = require('console');
const { Writable } = require('stream');

const OUT = Number(process.argv[2]);
const LANGUAGE = process.argv[3] || 'javascript';

function send(line) {
  fs.writeSync(OUT, JSON.stringify(line) + '\n');
}

function sink(type) {
  return {
    write(chunk, encoding, callback) {
      const text = typeof chunk === 'string' ? chunk : Buffer.from(chunk).toString('utf8');
      if (text) send({ type, text, timestamp: Date.now() * 1e6 });
      const done = typeof encoding === 'function' ? encoding : callback;
      if (typeof done === 'function') done();
      return true;
    },
  };
}

function stream(type) {
  const out = sink(type);
  return new Writable({ decodeStrings: false, write: (chunk, encoding, cb) => out.write(chunk, cb) });
}

const stdout = sink('stdout');
const stderr = sink('stderr');
globalThis.console = new Console({ stdout: stream('stdout'), stderr: stream('stderr') });
process.stdout.write = stdout.write;
process.stderr.write = stderr.write;
globalThis.require = (id) => Module.createRequire(path.join(process.cwd(), '[cell]'))(id);

let acorn = null;
let ts = null;

function transpile(code) {
  if (ts === null) ts = require('typescript');
  return ts.transpileModule(code, {
    compilerOptions: {
      target: ts.ScriptTarget.ES2022, module: ts.ModuleKind.ESNext, isolatedModules: true,
    },
    reportDiagnostics: false,
  }).outputText;
}

const IMPORT = /^([ \t]*)import\s+(?:([\w$]+)\s*,?\s*)?(?:\*\s*as\s+([\w$]+)\s*|(\{[^}]*\})\s*)?from\s*(['"][^'"\n]+['"])[ \t]*;?/gm;
const BARE_IMPORT = /^([ \t]*)import\s*(['"][^'"\n]+['"])[ \t]*;?/gm;

function rewriteImports(code) {
  return code.replace(IMPORT, (m, indent, def, ns, named, source) => {
    const parts = [];
    const mod = `require(${source})`;
    if (def) parts.push(`var ${def} = ((m) => (m && m.__esModule ? m.default : m))(${mod});`);
    if (ns) parts.push(`var ${ns} = ${mod};`);
    if (named) {
      const names = named.slice(1, -1).split(',').map((n) => n.trim()).filter(Boolean)
        .map((n) => n.replace(/^type\s+/, '').replace(/\s+as\s+/, ': '));
      parts.push(`var { ${names.join(', ')} } = ${mod};`);
    }
    return indent + parts.join(' ');
  }).replace(BARE_IMPORT, (m, indent, source) => `${indent}require(${source});`);
}

function asyncBody(code) {
  // the cell as the body of an async function: the last expression statement is returned,
  // top-level declarations of plain names become globals
  if (acorn === null) acorn = require('acorn');
  const ast = acorn.parse(code, {
    ecmaVersion: 'latest', sourceType: 'script', allowAwaitOutsideFunction: true,
    allowReturnOutsideFunction: true,
  });
  const edits = [];
  for (const node of ast.body) {
    if (node.type === 'VariableDeclaration'
        && node.declarations.every((d) => d.id.type === 'Identifier')) {
      edits.push([node.start, node.declarations[0].start, 'void (']);
      for (const d of node.declarations) {
        const name = d.id.name;
        edits.push([d.id.start, d.id.end, `globalThis[${JSON.stringify(name)}]`]);
        if (!d.init) edits.push([d.id.end, d.id.end, ' = undefined']);
      }
      const end = code[node.end - 1] === ';' ? node.end - 1 : node.end;
      edits.push([end, end, ')']);
    } else if (node.type === 'FunctionDeclaration' || node.type === 'ClassDeclaration') {
      if (node.id) edits.push([node.end, node.end, `;globalThis.${node.id.name} = ${node.id.name};`]);
    }
  }
  const last = ast.body[ast.body.length - 1];
  if (last && last.type === 'ExpressionStatement') {
    edits.push([last.start, last.start, 'return (']);
    const end = code[last.end - 1] === ';' ? last.end - 1 : last.end;
    edits.push([end, end, ')']);
  }
  edits.sort((a, b) => b[0] - a[0] || b[1] - a[1]);
  let out = code;
  for (const [start, end, text] of edits) out = out.slice(0, start) + text + out.slice(end);
  return `(async () => {\n${out}\n})()`;
}

function show(value) {
  if (value === undefined) return;
  const text = typeof value === 'string' ? value : util.inspect(value, { depth: 4 });
  send({ type: 'result', text, is_main_result: true });
}

function showError(err) {
  const isError = err instanceof Error;
  send({
    type: 'error',
    name: isError ? err.name : 'Error',
    value: isError ? err.message : String(err),
    traceback: isError && err.stack ? err.stack : String(err),
  });
}

async function runCell(code, typescript) {
  let source = typescript ? transpile(code) : code;
  source = rewriteImports(source);
  let value;
  if (/\bawait\b/.test(source)) {
    value = await vm.runInThisContext(asyncBody(source), { filename: '<cell>' });
  } else {
    value = vm.runInThisContext(source, { filename: '<cell>' });
  }
  show(value);
}

async function run(request) {
  const env = request.env || {};
  const saved = {};
  for (const [k, v] of Object.entries(env)) {
    saved[k] = process.env[k];
    process.env[k] = v;
  }
  try {
    await runCell(request.code, LANGUAGE === 'typescript' || request.typescript);
  } catch (err) {
    showError(err);
  } finally {
    for (const [k, v] of Object.entries(saved)) {
      if (v === undefined) delete process.env[k];
      else process.env[k] = v;
    }
  }
}

function become(request) {
  if (request.uid !== null && request.uid !== undefined && process.getuid() === 0) {
    process.setgroups(request.groups);
    process.setgid(request.gid);
    process.setuid(request.uid);
  }
  Object.assign(process.env, request.env || {});
  process.chdir(request.cwd);
}

async function main() {
  send({ type: 'ready' });
  const lines = readline.createInterface({ input: process.stdin, terminal: false });
  for await (const line of lines) {
    let request;
    try {
      request = JSON.parse(line);
    } catch (err) {
      continue;
    }
    try {
      if (request.op === 'run') await run(request);
      else if (request.op === 'become') become(request);
      else if (request.op === 'chdir') process.chdir(request.cwd);
    } catch (err) {
      showError(err);
    }
    send({ type: 'done' });
  }
}

process.on('unhandledRejection', (err) => showError(err));
process.on('uncaughtException', (err) => showError(err));
main();
