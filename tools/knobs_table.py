"""Prints the README's environment-variable table from the one declaration in csrc/core/env.cc."""
import commlib

print("| variable | default | meaning |")
print("| --- | --- | --- |")
for name, default, meaning in commlib.knobs():
    print(f"| `{name}` | `{default or '(empty)'}` | {meaning} |")
