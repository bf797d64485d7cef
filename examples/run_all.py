"""Run every example as its own process; exit 0 only if all of them succeed.

`make demo` runs `torchfix demo` (the incidents side by side); this runs the example scripts.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    scripts = sorted(p for p in HERE.glob("[0-9][0-9]_*.py"))
    env = {k: v for k, v in os.environ.items() if k != "TORCHFIX_MODE"}
    results = []
    for script in scripts:
        print(f"\n=== {script.name} " + "=" * max(0, 60 - len(script.name)), flush=True)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, str(script)], env=env, timeout=600)
        results.append((script.name, proc.returncode, time.perf_counter() - start))
    print("\n=== summary " + "=" * 50)
    for name, rc, secs in results:
        print(f"{'ok  ' if rc == 0 else 'FAIL'}  {name:32s} {secs:6.1f} s")
    return 0 if all(rc == 0 for _, rc, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
