"""Run a coordinator (bootstrap DHT peer, optional monitor): python peers/coordinator.py --help."""
from lioncub_p2p.cli.coordinator import main

if __name__ == "__main__":
    main()
