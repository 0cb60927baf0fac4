"""Ends with sys.exit(CODE) (first argument) after printing its arguments."""

import sys

print("args", sys.argv[1:])
sys.exit(int(sys.argv[1]))
