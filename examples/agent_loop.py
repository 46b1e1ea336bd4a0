"""A complete agent loop on Hangar's agent tools.

The model is Anthropic's (``ANTHROPIC_API_KEY`` set, ``pip install anthropic``), else
OpenAI's (``OPENAI_API_KEY``, ``pip install openai``), else a scripted stand-in that
plays a fixed plan, so the example runs anywhere. The loop never knows where a tool
runs: it hands each tool call to the task (the proxy) and gives the result back.

    .venv/bin/python examples/agent_loop.py                       # tier vm, scripted model
    .venv/bin/python examples/agent_loop.py --tier in-process     # no VM needed
    ANTHROPIC_API_KEY=... .venv/bin/python examples/agent_loop.py --task "..."

The Hangar server is found as by the SDK (``HANGAR_URL``, ``HANGAR_API_KEY`` or the key
file). The model's key stays in this process: tools run in a sandbox that never sees it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import hangar.tools as ht

SYSTEM = ("You are a careful engineer working in a sandbox. Use the tools to do the task; "
          "the work folder is /work. Reply with a short summary when you are done.")
DEFAULT_TASK = ("Write a JavaScript function add(a, b) in /work/add.js with a test in "
                "/work/add.test.js, run the test with node, and commit both files with git.")


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass
class Turn:
    text: str
    calls: list[ToolCall] = field(default_factory=list)
    tokens: int = 0


class Scripted:
    """A stand-in model: plays a fixed plan of tool calls for the tier, then summarizes."""

    JS = [
        ("write_file", {"path": "add.js", "content":
                        "function add(a, b) { return a + b; }\nmodule.exports = { add };\n"}),
        ("write_file", {"path": "add.test.js", "content":
                        "const { add } = require('./add');\n"
                        "if (add(2, 3) !== 5) { console.error('FAIL'); process.exit(1); }\n"
                        "console.log('PASS add(2, 3) = 5');\n"}),
        ("run_command", {"command": "node add.test.js"}),
        ("run_command", {"command": "git init -q && git add -A && git -c user.name=agent "
                                    "-c user.email=agent@example.com commit -qm 'add()' && "
                                    "git log --oneline"}),
        ("search_code", {"pattern": "function add"}),
    ]
    PLANS = {
        "in-process": [
            ("write_file", {"path": "add.py", "content": "def add(a, b):\n    return a + b\n"}),
            ("write_file", {"path": "test_add.py", "content":
                            "from add import add\nassert add(2, 3) == 5\nprint('PASS')\n"}),
            ("run_command", {"command": "python3 test_add.py"}),
            ("read_file", {"path": "add.py"}),
        ],
        "vm": JS,
        "browser": JS + [("browser_navigate", {"url": "file:///work/add.js"}),
                         ("browser_screenshot", {})],
    }

    def __init__(self, tier: str) -> None:
        self.steps = self.PLANS[tier]
        self.i = 0

    def start(self, task: str) -> None:
        pass

    def step(self) -> Turn:
        if self.i < len(self.steps):
            name, args = self.steps[self.i]
            self.i += 1
            return Turn(f"(step {self.i})", [ToolCall(f"call_{self.i}", name, args)], 100)
        return Turn("Done: add() is written and tested.", [], 50)

    def give(self, results: list[tuple[ToolCall, ht.ToolResult]]) -> None:
        for _call, r in results:
            if not r.ok:  # a real model would adapt; the script stops trying
                self.i = len(self.steps)


class Anthropic:
    def __init__(self, tier: str) -> None:
        import anthropic

        self.client = anthropic.Anthropic()
        self.model = os.environ.get("ANTHROPIC_MODEL", "claude-sonnet-4-5")
        self.tools = ht.anthropic_tools(tier)
        self.messages: list[dict[str, Any]] = []

    def start(self, task: str) -> None:
        self.messages = [{"role": "user", "content": task}]

    def step(self) -> Turn:
        msg = self.client.messages.create(model=self.model, max_tokens=4096, system=SYSTEM,
                                          tools=self.tools, messages=self.messages)
        self.messages.append({"role": "assistant", "content": msg.content})
        text = "".join(b.text for b in msg.content if b.type == "text")
        calls = [ToolCall(b.id, b.name, dict(b.input)) for b in msg.content if b.type == "tool_use"]
        return Turn(text, calls, msg.usage.input_tokens + msg.usage.output_tokens)

    def give(self, results: list[tuple[ToolCall, ht.ToolResult]]) -> None:
        self.messages.append({"role": "user",
                              "content": [r.to_anthropic(c.id) for c, r in results]})


class OpenAI:
    def __init__(self, tier: str) -> None:
        import openai

        self.client = openai.OpenAI()
        self.model = os.environ.get("OPENAI_MODEL", "gpt-4.1")
        self.tools = ht.openai_tools(tier)
        self.messages: list[dict[str, Any]] = []

    def start(self, task: str) -> None:
        self.messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]

    def step(self) -> Turn:
        resp = self.client.chat.completions.create(model=self.model, tools=self.tools,
                                                   messages=self.messages)
        m = resp.choices[0].message
        self.messages.append(m.model_dump(exclude_none=True))
        calls = [ToolCall(c.id, c.function.name, json.loads(c.function.arguments or "{}"))
                 for c in (m.tool_calls or [])]
        return Turn(m.content or "", calls, resp.usage.total_tokens if resp.usage else 0)

    def give(self, results: list[tuple[ToolCall, ht.ToolResult]]) -> None:
        self.messages += [r.to_openai(c.id) for c, r in results]


def pick_model(tier: str) -> Any:
    if os.environ.get("ANTHROPIC_API_KEY"):
        return Anthropic(tier)
    if os.environ.get("OPENAI_API_KEY"):
        return OpenAI(tier)
    return Scripted(tier)


async def run(task_text: str, tier: str, max_calls: int) -> ht.TaskResult:
    model = pick_model(tier)
    print(f"model: {type(model).__name__}; tier: {tier}")
    async with ht.task(tier=tier, user_id=os.environ.get("USER", "demo"), name="Example agent",
                       limits={"max_tool_calls": max_calls, "max_tokens": 200_000}) as t:
        print(f"task {t.task_id}: sandbox {t.sandbox_id or '(bubblewrap on this host)'} "
              f"from {t.source}")
        model.start(task_text)
        while True:
            turn = await asyncio.to_thread(model.step)
            t.report_tokens(turn.tokens)
            if turn.text:
                print(f"model: {turn.text}")
            if not turn.calls:
                break
            results = []
            for call in turn.calls:
                r = await t.call(call.name, call.arguments)  # the proxy: tier-independent
                print(f"  {call.name} {json.dumps(call.arguments)[:80]} -> "
                      f"{'ok' if r.ok else 'FAILED'} {r.text()[:200]!r}")
                results.append((call, r))
            model.give(results)
            if t.ended:  # the cost guard stopped it; the results said why
                break
    assert t.result is not None
    print(f"ended: {t.result.reason}; usage {t.result.usage.as_dict()}")
    return t.result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tier", default="vm", choices=list(ht.TIERS))
    ap.add_argument("--task", default=DEFAULT_TASK)
    ap.add_argument("--max-calls", type=int, default=10)
    a = ap.parse_args()
    if a.tier == "in-process" and a.task == DEFAULT_TASK:
        a.task = DEFAULT_TASK.replace(" with node", " with python3").replace(
            ", and commit both files with git", "")
    result = asyncio.run(run(a.task, a.tier, a.max_calls))
    return 0 if result.reason == "done" else 1


if __name__ == "__main__":
    sys.exit(main())
