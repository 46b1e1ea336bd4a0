# The R kernel's driver, run inside a code-interpreter guest by RKernel
# (code_interpreter_kernels.py): `Rscript --vanilla code_interpreter_r.R FD`.
#
# Requests, one JSON object a line on stdin:
#   {"op": "run", "code", "env"}  runs a cell in the global environment, one
#                                 top-level expression at a time: what an
#                                 expression prints is a "stdout" line, its
#                                 warnings and messages "stderr" lines; the
#                                 last expression's visible value is the
#                                 "result" (as print shows it), an earlier
#                                 visible value is printed to "stdout"; an
#                                 error ends the cell with an "error" line.
#                                 "env" holds for this cell only.
#   {"op": "chdir", "cwd"}        moves the process to cwd.
# Answers, one JSON object a line on file descriptor FD: {"type": "ready"}
# once, then each request's lines and {"type": "done"}.
# It needs R and the jsonlite package (Debian's r-base-core and r-cran-jsonlite).

args <- commandArgs(trailingOnly = TRUE)
answers <- file(paste0("/dev/fd/", args[[1]]), open = "w", encoding = "UTF-8", raw = TRUE)

send <- function(...) {
  line <- jsonlite::toJSON(list(...), auto_unbox = TRUE, null = "null")
  writeLines(enc2utf8(as.character(line)), answers, useBytes = TRUE)
  flush(answers)
}

send_error <- function(e) {
  message <- conditionMessage(e)
  call <- conditionCall(e)
  top <- is.null(call) || (is.call(call) && identical(call[[1]], quote(eval)))
  where <- if (top) "" else paste0(" in ", paste(deparse(call), collapse = " "))
  send(type = "error", name = "Error", value = message,
       traceback = paste0("Error", where, ": ", message))
}

run_cell <- function(code) {
  exprs <- tryCatch(parse(text = code, keep.source = FALSE), error = function(e) e)
  if (inherits(exprs, "error")) {
    send(type = "error", name = "SyntaxError", value = conditionMessage(exprs),
         traceback = conditionMessage(exprs))
    return(invisible(NULL))
  }
  n <- length(exprs)
  for (i in seq_len(n)) {
    printed <- character(0)
    to_printed <- textConnection("printed", "w", local = TRUE)
    sink(to_printed)
    got <- tryCatch(
      withCallingHandlers(
        withVisible(eval(exprs[[i]], envir = globalenv())),
        warning = function(w) {
          send(type = "stderr", text = paste0("Warning message:\n", conditionMessage(w), "\n"))
          invokeRestart("muffleWarning")
        },
        message = function(m) {
          send(type = "stderr", text = conditionMessage(m))
          invokeRestart("muffleMessage")
        }),
      error = function(e) e)
    shown <- NULL
    if (!inherits(got, "error") && isTRUE(got$visible)) {
      shown <- tryCatch(capture.output(print(got$value)), error = function(e) e)
    }
    sink()
    close(to_printed)
    if (inherits(shown, "error")) {
      got <- shown
      shown <- NULL
    }
    if (!is.null(shown) && i < n) {
      printed <- c(printed, shown)
      shown <- NULL
    }
    if (length(printed)) {
      send(type = "stdout", text = paste0(paste(printed, collapse = "\n"), "\n"))
    }
    if (!is.null(shown)) {
      send(type = "result", text = paste(shown, collapse = "\n"), is_main_result = TRUE)
    }
    if (inherits(got, "error")) {
      send_error(got)
      return(invisible(NULL))
    }
  }
  invisible(NULL)
}

run <- function(request) {
  env <- request$env
  saved <- list()
  for (name in names(env)) {
    saved[[name]] <- Sys.getenv(name, unset = NA)
    do.call(Sys.setenv, stats::setNames(list(as.character(env[[name]])), name))
  }
  on.exit({
    for (name in names(saved)) {
      if (is.na(saved[[name]])) {
        Sys.unsetenv(name)
      } else {
        do.call(Sys.setenv, stats::setNames(list(saved[[name]]), name))
      }
    }
  })
  run_cell(request$code)
}

send(type = "ready")
requests <- file("stdin", open = "r", encoding = "UTF-8")
repeat {
  line <- readLines(requests, n = 1, warn = FALSE)
  if (length(line) == 0) break
  request <- tryCatch(jsonlite::fromJSON(line, simplifyVector = FALSE), error = function(e) NULL)
  if (is.null(request)) next
  tryCatch({
    if (identical(request$op, "run")) run(request)
    else if (identical(request$op, "chdir")) setwd(request$cwd)
  }, error = function(e) send_error(e))
  send(type = "done")
}
