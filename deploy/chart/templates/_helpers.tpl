{{/* Labels every object of the release carries. */}}
{{- define "zebu.labels" -}}
app.kubernetes.io/name: zebu
app.kubernetes.io/part-of: zebu
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{- define "zebu.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
