"""``torchrun ... -m automicro.torchtitan --module llama3 --config llama3_8b --training.local_batch_size auto``."""

from automicro.torchtitan import main

if __name__ == "__main__":
    main()
