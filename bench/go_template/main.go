// Renders an Ollama chat template with Go's text/template, as Ollama does: the input (JSON on stdin) is the
// template and conversations, each a list of {"role", "content"}; the output (JSON on stdout) is each
// conversation's rendering, with the messages as .Messages.
package main

import (
	"encoding/json"
	"os"
	"strings"
	"text/template"
)

type message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type request struct {
	Template      string      `json:"template"`
	Conversations [][]message `json:"conversations"`
}

func main() {
	var in request
	if err := json.NewDecoder(os.Stdin).Decode(&in); err != nil {
		panic(err)
	}
	tmpl := template.Must(template.New("chat").Parse(in.Template))
	out := []string{}
	for _, messages := range in.Conversations {
		var b strings.Builder
		if err := tmpl.Execute(&b, map[string]any{"Messages": messages}); err != nil {
			panic(err)
		}
		out = append(out, b.String())
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		panic(err)
	}
}
