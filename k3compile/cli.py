def main(argv=None):
    print("k3compile")
