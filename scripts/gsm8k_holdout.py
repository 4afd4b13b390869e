"""`make real REAL=smollm2-135m-gsm8k`'s inputs: GSM8K's train split into inputs/gsm8k/{train,heldout}.jsonl (the
command line of agentrl.experiments.recipe.gsm8k_holdout_main; its --help says how)."""

from agentrl.experiments.recipe import gsm8k_holdout_main as main

if __name__ == "__main__":
    main()
