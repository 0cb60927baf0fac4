from mnb.worker.main import main

if __name__ == "__main__":
    main()
