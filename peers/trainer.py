"""Run a volunteer trainer: python peers/trainer.py --initial-peers ... (see --help)."""
from lioncub_p2p.cli.train import main

if __name__ == "__main__":
    main()
