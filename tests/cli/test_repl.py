"""`ferrum run` in a real terminal (tmux): multi-line input, /system, Ctrl-C stopping an
answer without ending the session, tokens/s after each answer, /exit."""

import shlex
import subprocess
import time
import uuid


class Tmux:
    def __init__(self, command):
        self.name = "ferrum-" + uuid.uuid4().hex[:8]
        subprocess.run(["tmux", "new-session", "-d", "-s", self.name, "-x", "160", "-y", "50",
                        command + "; sleep 30"], check=True)

    def keys(self, *keys):
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def screen(self):
        return subprocess.run(["tmux", "capture-pane", "-p", "-S", "-200", "-t", self.name],
                              check=True, capture_output=True, text=True).stdout

    def wait_for(self, predicate, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            s = self.screen()
            if predicate(s):
                return s
            time.sleep(0.1)
        raise AssertionError("timed out; screen:\n" + self.screen())

    def close(self):
        subprocess.run(["tmux", "kill-session", "-t", self.name], check=False)


def test_repl_in_a_terminal(ferrum, model):
    t = Tmux(f"{shlex.quote(ferrum)} run {shlex.quote(model)} --temperature 0 --max-tokens 300 --ctx 2048; echo EXITED-$?")
    try:
        t.wait_for(lambda s: "Ctrl-C stops an answer" in s and s.rstrip().endswith(">"))
        # A long answer, interrupted: the session goes on.
        t.keys("Write a very long story about the history of the sea, in great detail.", "Enter")
        t.wait_for(lambda s: len(s.split("in great detail.")[-1].strip()) > 40)
        t.keys("C-c")
        s = t.wait_for(lambda s: "[interrupted]" in s and s.count("tok/s]") == 1)
        assert "EXITED" not in s
        generated = int(s.split("computed) in ")[1].split("s, ")[1].split(" tokens")[0])
        assert generated < 300, "stopped early, not at max_tokens"
        t.keys("/system You answer in one short sentence.", "Enter")
        t.wait_for(lambda s: "(system prompt set)" in s)
        # Three lines between triple quotes are one message.
        for line in ['"""Here is a list:', "apples, pears", 'Which one is red?"""']:
            t.keys(line, "Enter")
        s = t.wait_for(lambda s: s.count("tok/s]") == 2)
        assert ". apples, pears" in s  # the continuation prompt
        t.keys("What is 2 plus 2?", "Enter")
        t.wait_for(lambda s: s.count("tok/s]") == 3)
        t.keys("/exit", "Enter")
        t.wait_for(lambda s: "EXITED-0" in s)
    finally:
        t.close()
