fn main() {
    std::process::exit(soar_gptq::cli::main());
}
