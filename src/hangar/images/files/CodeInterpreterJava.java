// The Java kernel's driver, run inside a code-interpreter guest by JavaKernel
// (code_interpreter_kernels.py): `java CodeInterpreterJava.java FD`, on JShell's API
// with local execution (the cells run in this JVM).
//
// Requests, one a line on stdin, fields separated by tabs, each base64 (UTF-8):
//   run <code> [<name>=<value> ...]   runs a cell, one JShell snippet at a time: what it
//                                     prints is "stdout"/"stderr" lines (a line's text
//                                     and its newline as two), the last snippet's value
//                                     the "result" (a String's own text, other values as
//                                     JShell shows them), a snippet that does not compile
//                                     or throws ends the cell with an "error" line. The
//                                     name=value pairs are system properties for this
//                                     cell (E2B's Java kernel gives a run's envs so).
//   chdir <folder>                    sets user.dir.
// Answers, one JSON object a line on file descriptor FD: {"type": "ready"} once, then
// each request's lines and {"type": "done"}. The environment variables named in the
// system property hangar.properties (comma-separated) are copied to system properties at
// start (the sandbox's envs, as E2B's Java kernel gives them).

import java.io.ByteArrayOutputStream;
import java.io.FileOutputStream;
import java.io.OutputStream;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Base64;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.stream.Collectors;

import jdk.jshell.EvalException;
import jdk.jshell.JShell;
import jdk.jshell.Snippet;
import jdk.jshell.SnippetEvent;
import jdk.jshell.SourceCodeAnalysis;

public class CodeInterpreterJava {
    private static PrintStream answers;

    /** One answer line from name, value pairs: a value is a string, or a boolean. */
    static synchronized void send(Object... pairs) {
        StringBuilder b = new StringBuilder("{");
        for (int i = 0; i < pairs.length; i += 2) {
            if (i > 0) b.append(", ");
            Object value = pairs[i + 1];
            b.append(quote((String) pairs[i])).append(": ")
             .append(value instanceof Boolean ? value.toString() : quote((String) value));
        }
        answers.print(b.append("}\n"));
        answers.flush();
    }

    static String quote(String s) {
        StringBuilder b = new StringBuilder("\"");
        for (int i = 0; i < s.length(); i++) {
            char c = s.charAt(i);
            switch (c) {
                case '"': b.append("\\\""); break;
                case '\\': b.append("\\\\"); break;
                case '\n': b.append("\\n"); break;
                case '\r': b.append("\\r"); break;
                case '\t': b.append("\\t"); break;
                default:
                    if (c < 0x20) b.append(String.format("\\u%04x", (int) c));
                    else b.append(c);
            }
        }
        return b.append('"').toString();
    }

    /** An output stream that sends what is written as "stdout"/"stderr" lines. */
    static final class Lines extends OutputStream {
        private final String kind;
        private final ByteArrayOutputStream pending = new ByteArrayOutputStream();

        Lines(String kind) { this.kind = kind; }

        @Override public synchronized void write(int b) {
            pending.write(b);
            if (b == '\n') flush();
        }

        @Override public synchronized void write(byte[] b, int off, int len) {
            pending.write(b, off, len);
            flush();
        }

        @Override public synchronized void flush() {
            if (pending.size() == 0) return;
            String text = pending.toString(StandardCharsets.UTF_8);
            pending.reset();
            int start = 0;
            for (int nl = text.indexOf('\n'); nl >= 0; nl = text.indexOf('\n', start)) {
                if (nl > start) send("type", kind, "text", text.substring(start, nl));
                send("type", kind, "text", "\n");
                start = nl + 1;
            }
            if (start < text.length()) send("type", kind, "text", text.substring(start));
        }
    }

    static String decode(String field) {
        return new String(Base64.getDecoder().decode(field), StandardCharsets.UTF_8);
    }

    static String shown(String value) {
        // JShell shows a String as a Java literal: its own text is what a cell's value is
        if (value != null && value.length() >= 2
                && value.startsWith("\"") && value.endsWith("\"")) {
            String inner = value.substring(1, value.length() - 1);
            StringBuilder b = new StringBuilder();
            for (int i = 0; i < inner.length(); i++) {
                char c = inner.charAt(i);
                if (c == '\\' && i + 1 < inner.length()) {
                    char n = inner.charAt(++i);
                    switch (n) {
                        case 'n': b.append('\n'); break;
                        case 't': b.append('\t'); break;
                        case 'r': b.append('\r'); break;
                        case '"': b.append('"'); break;
                        case '\\': b.append('\\'); break;
                        default: b.append('\\').append(n);
                    }
                } else {
                    b.append(c);
                }
            }
            return b.toString();
        }
        return value;
    }

    static void runCell(JShell shell, String code, PrintStream out, PrintStream err) {
        SourceCodeAnalysis analysis = shell.sourceCodeAnalysis();
        String rest = code;
        String last = null;
        while (rest != null && !rest.isBlank()) {
            SourceCodeAnalysis.CompletionInfo info = analysis.analyzeCompletion(rest);
            String source = info.source();
            if (source == null || info.completeness() == SourceCodeAnalysis.Completeness.EMPTY) {
                source = rest;  // incomplete: JShell says what is missing
                rest = null;
            } else {
                rest = info.remaining();
            }
            last = null;
            for (SnippetEvent event : shell.eval(source)) {
                out.flush();
                err.flush();
                if (event.exception() != null) {
                    Throwable t = event.exception();
                    String name = t instanceof EvalException
                            ? ((EvalException) t).getExceptionClassName() : t.getClass().getName();
                    String message = t.getMessage() == null ? "" : t.getMessage();
                    send("type", "error", "name", name, "value", message,
                         "traceback", name + ": " + message);
                    return;
                }
                if (event.status() == Snippet.Status.REJECTED) {
                    String why = shell.diagnostics(event.snippet()).map(d -> d.getMessage(null))
                            .collect(Collectors.joining("\n"));
                    send("type", "error", "name", "CompilationException", "value", why,
                         "traceback", why);
                    return;
                }
                if (event.causeSnippet() == null && event.value() != null
                        && (event.snippet().kind() == Snippet.Kind.EXPRESSION
                            || event.snippet().subKind()
                               == Snippet.SubKind.TEMP_VAR_EXPRESSION_SUBKIND)) {
                    last = event.value();
                }
            }
        }
        if (last != null) send("type", "result", "text", shown(last), "is_main_result", true);
    }

    public static void main(String[] args) throws Exception {
        answers = new PrintStream(new FileOutputStream("/dev/fd/" + args[0]), false,
                                  StandardCharsets.UTF_8);
        String names = System.getProperty("hangar.properties");
        if (names != null) {
            for (String name : names.split(",")) {
                String value = System.getenv(name);
                if (!name.isEmpty() && value != null) System.setProperty(name, value);
            }
        }
        PrintStream out = new PrintStream(new Lines("stdout"), true, StandardCharsets.UTF_8);
        PrintStream err = new PrintStream(new Lines("stderr"), true, StandardCharsets.UTF_8);
        System.setOut(out);
        System.setErr(err);
        JShell shell = JShell.builder().executionEngine("local").out(out).err(err).build();
        shell.eval("int __hangar_warm = 1;");  // JShell's first compile: before "ready"
        send("type", "ready");
        java.io.BufferedReader in = new java.io.BufferedReader(
                new java.io.InputStreamReader(System.in, StandardCharsets.UTF_8));
        for (String line; (line = in.readLine()) != null; ) {
            String[] fields = line.split("\t", -1);
            try {
                if (fields[0].equals("run") && fields.length >= 2) {
                    Map<String, String> saved = new LinkedHashMap<>();
                    List<String> unset = new ArrayList<>();
                    for (int i = 2; i < fields.length; i++) {
                        String pair = decode(fields[i]);
                        int eq = pair.indexOf('=');
                        if (eq <= 0) continue;
                        String name = pair.substring(0, eq);
                        String old = System.getProperty(name);
                        if (old == null) unset.add(name); else saved.put(name, old);
                        System.setProperty(name, pair.substring(eq + 1));
                    }
                    try {
                        runCell(shell, decode(fields[1]), out, err);
                    } finally {
                        saved.forEach(System::setProperty);
                        unset.forEach(System::clearProperty);
                    }
                } else if (fields[0].equals("chdir") && fields.length >= 2) {
                    System.setProperty("user.dir", decode(fields[1]));
                }
            } catch (Throwable t) {
                send("type", "error", "name", t.getClass().getName(),
                     "value", String.valueOf(t.getMessage()), "traceback", t.toString());
            }
            out.flush();
            err.flush();
            send("type", "done");
        }
    }
}
