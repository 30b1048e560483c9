"""Train a tool-using agent (a calculator tool through `tools=[...]`):
`python -m environments.calculator --model Qwen/Qwen2.5-1.5B-Instruct --steps 20` (on SGLang the server
needs the model's tool-call parser; see environments/README.md)."""

from environments.calculator import CalculatorTask
from environments.common import main

main(CalculatorTask(), __doc__)
